"""fp8 expert GEMMs (Hopper: e4m3/e5m2 operands, fp32 accumulation) over the routing index.

The recipes are ``relaymoe.fp8_recipe``'s (TE's names). Files: ``quant_torch`` (the quantisers in
plain torch: the weights', and the reference of the Triton ones), ``quantize`` (the Triton
quantisation helpers and the row quantiser), ``weights`` (a range's fp8 weights in both layouts),
``scaling`` (current and delayed tensor scales), ``rows`` (the row GEMM: down projection and
dgrad), ``up`` (the gathered up-projection with the activation and ``a``'s quantisation in its
epilogue), ``wgrad`` (the tensor-scaled weight gradients), ``columns`` (their K-major
operands), ``hop`` (the fp8 hop forward and
backward). Submodules are imported by name (nothing here), so ``grouped`` can use ``quantize``
without an import cycle.
"""
