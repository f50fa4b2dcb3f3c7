"""``relaymoe.options``' numbers are bounded, and a bad environment value names its variable.

A timeout must be a finite number of seconds in ``(0, MAX_TIMEOUT_S]`` (inf or 1e15 overflowed
``timedelta`` at the first wait, reported as a dead peer); an int option lies within int64 (and
``pair_buffer_mib``'s bytes too: 2**63 overflowed the agreement's row inside torch). A value from
``RELAYMOE_*`` is refused by ``from_env`` naming the variable and its raw text, the limit and the
fix, not only the field it sets.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta

import pytest

from relaymoe.options import INT64_MAX, MAX_TIMEOUT_S, KernelOptions, RingConfig, from_env


@pytest.mark.parametrize("value", [0, -3, 0.0, math.nan, math.inf, -math.inf, 1e15,
                                   MAX_TIMEOUT_S + 1, True, "60"])  # fmt: skip
def test_timeout_is_finite_positive_and_at_most_a_week(value):
    with pytest.raises(ValueError) as info:
        RingConfig(timeout_s=value)
    msg = str(info.value)
    assert f"RingConfig.timeout_s={value!r} must be a number of seconds in (0, 604800]" in msg
    assert "at most 7 days" in msg and "the default is None" in msg, msg


@pytest.mark.parametrize("value", [None, 1e-3, 30, 1800.5, MAX_TIMEOUT_S])
def test_timeouts_within_the_bound_are_kept_and_fit_a_timedelta(value):
    assert RingConfig(timeout_s=value).timeout_s == value
    if value is not None:  # what faults.PeerWatch.wait builds from it
        timedelta(seconds=value)


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (lambda: RingConfig(gpus_per_node=2**63), r"gpus_per_node=9223372036854775808 must be "
         r"an int in \[1, 9223372036854775807\] or None"),
        (lambda: RingConfig(gpus_per_node=0), r"gpus_per_node=0 must be an int in \[1, "),
        (lambda: KernelOptions(pair_buffer_mib=2**63), r"pair_buffer_mib=9223372036854775808 "
         r"must be an int in \[0, 8796093022207\] \(MiB budget"),
        (lambda: KernelOptions(pair_buffer_mib=-1), r"pair_buffer_mib=-1 must be an int in \[0,"),
    ],
)  # fmt: skip
def test_int_options_lie_within_int64(make, text):
    with pytest.raises(ValueError, match=text):
        make()


def test_largest_ints_are_accepted():
    assert RingConfig(gpus_per_node=INT64_MAX).gpus_per_node == INT64_MAX
    k = KernelOptions(pair_buffer_mib=INT64_MAX >> 20)
    assert k.pair_buffer_mib * 2**20 <= INT64_MAX  # its bytes an int64


@pytest.mark.parametrize(
    ("var", "raw", "field", "limit"),
    [
        ("RELAYMOE_RING_TIMEOUT_S", "0", "RingConfig.timeout_s=0.0", "(0, 604800]"),
        ("RELAYMOE_RING_TIMEOUT_S", "-3", "RingConfig.timeout_s=-3.0", "(0, 604800]"),
        ("RELAYMOE_RING_TIMEOUT_S", "nan", "RingConfig.timeout_s=nan", "(0, 604800]"),
        ("RELAYMOE_RING_TIMEOUT_S", "inf", "RingConfig.timeout_s=inf", "(0, 604800]"),
        ("RELAYMOE_RING_TIMEOUT_S", "1e15", "RingConfig.timeout_s=1000000000000000.0",
         "(0, 604800]"),
        ("RELAYMOE_PAIR_BUFFER_MIB", "-1", "KernelOptions.pair_buffer_mib=-1",
         "[0, 8796093022207]"),
        ("RELAYMOE_PAIR_BUFFER_MIB", "9223372036854775808",
         "KernelOptions.pair_buffer_mib=9223372036854775808", "[0, 8796093022207]"),
    ],
)  # fmt: skip
def test_environment_errors_name_the_variable_its_value_the_limit_and_the_fix(
    var, raw, field, limit
):
    with pytest.raises(ValueError) as info:
        from_env({var: raw})
    msg = str(info.value)
    assert msg.startswith(f"{var}={raw!r} (environment) is refused: {field} must be "), msg
    assert limit in msg and f"set {var} within that range, or unset it for the default" in msg


def test_environment_values_within_bounds_apply():
    opts = from_env({"RELAYMOE_RING_TIMEOUT_S": "604800", "RELAYMOE_PAIR_BUFFER_MIB": "0"})
    assert opts.timeout_s == MAX_TIMEOUT_S and opts.kernels.pair_buffer_mib == 0
    with pytest.raises(ValueError, match=re.escape("RELAYMOE_RING_TIMEOUT_S='soon' must be a")):
        from_env({"RELAYMOE_RING_TIMEOUT_S": "soon"})
