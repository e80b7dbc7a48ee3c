"""Offload a small input so that a large tensor computed from it is recomputed instead of copied (a move of the
budget planner, made on each start's plan after its keep search).

Why: the budget planner's "fewest offloads" start (``budget.fit_budget``) picks tensors by bytes x distance, so
with a large budget it offloads the few largest, longest-lived tensors of a U-Net: the first level's convolution
outputs. Their producer keeps its own input on the device (the image: small, so never worth offloading for
memory), and without a host copy of that input the output cannot be recomputed (every recompute starts from
host copies, ``planning.recompute``): it is copied, and comes back at the end of the backward with nothing left
to hide behind. At 384^3 float32 with a 64 GiB budget on H100-PCIe5 that plan copies 3.4 GiB out and 6.9 back
and is predicted at 1.54x the plain step. Offloading the 216 MiB image instead lets the planner recompute the
16-channel output from it in windows (one cheap convolution per read): 1.04x. The other start ("every eligible
tensor offloaded") has every such input offloaded already, but recomputes and sweeps far more than a large
budget needs (1.67x at 40 and 48 GiB).

The move: each call the plan keeps whose output some reader copies to host, whose inputs are at most
``MAX_INPUT_SHARE`` of that output (a convolution widening its channels, an up-sampler), largest output first
and at most ``MAX_TRIALS`` of them, is tried with its inputs offloaded (only those the user's rules let go to
host: include/exclude, keep_last, min_bytes); the caller re-plans (recomputed tensors,
sweeps, prefetch) and keeps a trial that fits the budget and is predicted faster. Whether the output is then
recomputed or still copied is the re-plan's choice, by time.
"""

from __future__ import annotations

import logging

from keras_lms.planning import rules
from keras_lms.planning.memory_model import tensor_sizes
from keras_lms.planning.plan import CallDecision, offloaded_keys

log = logging.getLogger(__name__)

# A candidate's inputs are at most this share of its output's bytes: offloading them costs little link time and
# host memory against the copies of the output they may replace.
MAX_INPUT_SHARE = 0.25
# Each trial is a re-plan (about half a second for a 3D U-Net on a 2-core machine): the largest outputs only.
MAX_TRIALS = 3
# A trial must shorten the predicted step by this share (below the model's accuracy it only adds copies).
MIN_GAIN = 1e-3


def source_candidates(calls, decisions, policy, batch_size: int) -> list:
    """The kept calls whose output a reader offloads and whose inputs are small (module docstring), largest
    output first, at most ``MAX_TRIALS``; only calls whose inputs the user's rules let go to host (``policy``:
    ``rules.decide_all``, before the budget narrowed it: include/exclude, keep_last, min_bytes, what the back end
    cannot offload)."""
    sizes_in, sizes_out, keys_out = tensor_sizes(calls, batch_size)
    copied = offloaded_keys(calls, decisions)
    found = []
    for i, d in enumerate(decisions):
        if d.offloaded or not policy[i].offloaded or len(keys_out[i]) != 1 or keys_out[i][0] not in copied:
            continue
        if sum(sizes_in[i]) <= MAX_INPUT_SHARE * sizes_out[i][0]:
            found.append((sizes_out[i][0], i))
    return [i for _, i in sorted(found, key=lambda t: (-t[0], t[1]))[:MAX_TRIALS]]


def with_sources_offloaded(decisions, policy, indices, profile_name: str) -> list:
    """``decisions`` with the inputs of the calls ``indices`` that ``policy`` lets go to host offloaded, each with
    its reason."""
    out = list(decisions)
    for i in indices:
        out[i] = CallDecision(list(policy[i].offload_tensor),
                              f"offloaded: a small input of a large output, so that the output can be recomputed "
                              f"from its host copy instead of copied (a shorter predicted step on {profile_name})",
                              decisions[i].slab_bytes)
    return out


def offload_sources(calls, decisions, config, batch_size: int, try_plan, seconds_now: float) -> tuple:
    """Greedy over ``source_candidates`` (under the rules of ``config``, an ``LMSConfig`` with a device profile):
    ``try_plan(decisions)`` re-plans and returns ``(seconds, plan)``, or None where the plan does not fit the
    budget; a candidate is kept when its plan is faster than the best so far (at first the plan of
    ``decisions``, ``seconds_now``). Returns ``(decisions, plan, seconds)`` of the best, with ``plan`` None when
    no candidate was kept."""
    policy, profile_name = rules.decide_all(calls, config, batch_size), config.device_profile.name
    best_decisions, best_plan, best_seconds = decisions, None, seconds_now
    taken = []
    for i in source_candidates(calls, decisions, policy, batch_size):
        trial = with_sources_offloaded(decisions, policy, taken + [i], profile_name)
        result = try_plan(trial)
        if result is None:
            continue
        seconds, plan = result
        if seconds < best_seconds * (1 - MIN_GAIN):
            taken.append(i)
            best_decisions, best_plan, best_seconds = trial, plan, seconds
    if best_plan is not None:
        log.info("keras-lms: offloading the inputs of %s so that their outputs are recomputed (predicted step "
                 "%.3f s instead of %.3f s on %s).", ", ".join(calls[i].unit.name for i in taken), best_seconds,
                 seconds_now, profile_name)
    return best_decisions, best_plan, best_seconds
