"""Where a training step's memory peak falls, and what it is made of, in the planner's terms.

``relaymoe.megatron.pretrain --relaymoe-memory-phases`` (with ``--relaymoe-report PATH``) adds a
``memory_phases`` object to each step's report line: the caching allocator's counters read at
the step's phase boundaries, and the breakdown of the step's peak they give.

Marks (``MARKS``), each ``(memory_allocated, max_memory_allocated)`` at its first occurrence in
the step: ``forward_start`` (the GPT model's forward pre-hook), ``loss_start`` (the final norm's
forward pre-hook: the layers' forward is done and what they keep for backward is allocated),
``forward_end`` (the model's forward hook: the output layer and the loss ran inside it),
``optimizer_start`` (the optimizer's ``step`` called: backward and gradient reductions are
done) and ``step_end``. The step report resets the peak counter when the step starts, so a
mark's maximum is the running maximum since then: nothing here resets it, and nothing waits for
the GPU (the caching allocator counts in the host's order, which is the order its out-of-memory
error comes in).

The breakdown (``breakdown``) names the terms as ``relaymoe.planner`` does
(``recompute.comparable_terms``): ``model_states`` (what is allocated when the forward starts:
parameters, gradient buffers, optimizer states), ``activations_retained`` (what the layers
hold when the loss starts), and the transient of the phase the peak falls in, over those:
``layer_working_set`` (in the layers' forward or backward), ``logits_loss`` (the final norm, the
output layer and the loss) or ``optimizer_step``. The other transients did not raise the running
maximum, so they are not at the peak: None. One micro-batch a step is what the marks describe
(later micro-batches' marks are not taken).

Chosen over an allocator snapshot (``benchmarks/memory_timeline.py``'s machinery): recording
every allocation of a long-sequence step with its stack costs time and memory in the very run
being measured, and the snapshot's blocks would still need these boundaries to be split into
the planner's terms.
"""

from __future__ import annotations

from relaymoe.planner.recompute import binding_term

MARKS = ("forward_start", "loss_start", "forward_end", "optimizer_start", "step_end")
# the phase that each mark ends, in order
PHASES = ("before_forward", "layers_forward", "loss", "backward", "optimizer")
# the planner's name of each phase's transient over model states + retained activations
PHASE_TERM = {
    "before_forward": "optimizer_step",  # the step's start: what the last step left behind
    "layers_forward": "layer_working_set",
    "loss": "logits_loss",
    "backward": "layer_working_set",
    "optimizer": "optimizer_step",
}
TRANSIENT_TERMS = ("layer_working_set", "logits_loss", "optimizer_step")


def breakdown(marks: dict) -> dict:
    """The step's peak from its ``marks`` (name -> ``(allocated, max_allocated)`` bytes):
    ``peak_bytes``, ``peak_phase``, ``terms`` (summing to the peak; the transients not at the
    peak None), ``binding_term`` (``planner.recompute.binding_term`` over the terms; the
    transient's own name when the peak lies outside the forward and backward) and the
    ``marks``. Raises ``ValueError`` naming the marks a step lacks."""
    missing = [m for m in MARKS if m not in marks]
    if missing:
        raise ValueError(
            f"memory marks {missing} were not taken this step (taken: {sorted(marks)}); the "
            "phases need a GPT model with a final norm on this rank and an optimizer step"
        )
    alloc = {k: int(marks[k][0]) for k in MARKS}
    peak = int(marks["step_end"][1])
    # the phase that first reached the step's peak: the running maximum is monotone
    phase = next(PHASES[i] for i, m in enumerate(MARKS) if int(marks[m][1]) >= peak)
    states = alloc["forward_start"]
    terms: dict = {"model_states": states, "activations_retained": None}
    terms.update(dict.fromkeys(TRANSIENT_TERMS))
    if phase in ("layers_forward", "loss", "backward"):
        terms["activations_retained"] = alloc["loss_start"] - states
        terms[PHASE_TERM[phase]] = peak - alloc["loss_start"]
        binding = binding_term(terms)
    else:
        terms["optimizer_step"] = peak - states
        binding = "optimizer_step"
    return {
        "peak_bytes": peak,
        "peak_phase": phase,
        "terms": terms,
        "binding_term": binding,
        "marks": {k: [int(marks[k][0]), int(marks[k][1])] for k in MARKS},
    }


def gpt_model(chunks):
    """The ``GPTModel`` inside Megatron's (wrapped) model chunks that runs the loss: the last
    chunk's module with a ``decoder`` and an ``output_layer``; None on a rank without one."""
    for chunk in reversed(list(chunks)):
        for m in chunk.modules():
            if hasattr(m, "decoder") and hasattr(m, "output_layer"):
                return m
    return None


class PhaseRecorder:
    """Takes the ``MARKS`` of each training step (``attach`` once, then ``start`` and
    ``finish`` around every step); ``finish`` returns the step's ``breakdown``, or a dict with
    ``error`` where the marks are incomplete (a rank without the model's last stage)."""

    def __init__(self):
        self.marks: dict = {}
        self.attached = False

    def mark(self, name: str) -> None:
        import torch

        if name not in self.marks:
            self.marks[name] = (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())

    def attach(self, chunks, optimizer) -> None:
        """Hooks on the GPT model and its final norm, and a wrapper on ``optimizer.step``."""
        if self.attached:
            return
        self.attached = True
        model = gpt_model(chunks if isinstance(chunks, list | tuple) else [chunks])
        if model is not None:
            model.register_forward_pre_hook(lambda *_: self.mark("forward_start"))
            model.register_forward_hook(lambda *_: self.mark("forward_end"))
            norm = getattr(model.decoder, "final_layernorm", None)
            if norm is not None:
                norm.register_forward_pre_hook(lambda *_: self.mark("loss_start"))
        step = optimizer.step

        def marked_step(*a, **kw):
            self.mark("optimizer_start")
            return step(*a, **kw)

        optimizer.step = marked_step

    def start(self) -> None:
        self.marks = {}

    def finish(self) -> dict:
        self.mark("step_end")
        try:
            return breakdown(self.marks)
        except ValueError as e:
            return {"error": str(e), "marks": {k: list(v) for k, v in self.marks.items()}}
