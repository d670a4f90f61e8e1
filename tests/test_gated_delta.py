"""Gated DeltaNet's one schedule (samepath.kernels.gated_delta): prefill == chunked prefill split
anywhere == packed == token-by-token decode, bit for bit, through the packed cache and through the
slot buffers (mixed prefill / decode batches); close to the float64 recurrence; the Triton backward
deterministic and close to float64 autograd; replay == interpreter (forward, slot path, backward);
negative controls; bad inputs refused by name."""

from __future__ import annotations

import itertools

import pytest
import torch

from samepath.kernels import gated_delta as gd
from samepath.kernels.dispatch import ReplayMismatch, cpu_executor
from samepath.kernels.replay import gated_delta as gd_replay

#: The consistency cases: the first runs the Triton source under the interpreter, the others the
#: CPU replay (proven bit-identical to the interpreter by the verify test below; ~10x faster).
_INTERPRETED = pytest.mark.interpreter

C = gd.CHUNK


def _inputs(total, hk, hv, dk, dv, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, hk, dk, generator=gen).to(dtype)
    k = torch.randn(total, hk, dk, generator=gen).to(dtype)
    v = torch.randn(total, hv, dv, generator=gen).to(dtype)
    g = -torch.nn.functional.softplus(torch.randn(total, hv, generator=gen)) * 0.5
    beta = torch.sigmoid(torch.randn(total, hv, generator=gen))
    return q, k, v, g, beta


def _recurrent64(q, k, v, g, beta, cu, state=None):
    """Hugging Face's recurrent rule (torch_recurrent_gated_delta_rule with L2-normalised q/k), float64,
    from ``state`` ``[N, HV, DK, DV]`` (zeros if None)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    hv, dk = v.shape[1], q.shape[2]
    q, k = (x.repeat_interleave(hv // x.shape[1], dim=1) for x in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    outs, cu = [], cu.tolist()
    for i, (a, b) in enumerate(itertools.pairwise(cu)):
        s = torch.zeros(hv, dk, v.shape[2], dtype=torch.float64) if state is None else state[i].double()
        for t in range(a, b):
            s = s * g[t].exp()[:, None, None]
            delta = (v[t] - (s * k[t][:, :, None]).sum(1)) * beta[t][:, None]
            s = s + k[t][:, :, None] * delta[:, None, :]
            outs.append((s * q[t][:, :, None]).sum(1))
    return torch.stack(outs)


def _split(x, cu):
    return [x[a:b] for a, b in itertools.pairwise(cu)]


def _continue_in_pieces(inputs, lengths, cuts):
    """Feed each sequence in pieces ending at ``cuts`` (positions), all sequences at once per step."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    per_seq = [_split(x, cu) for x in inputs]
    outs = [[] for _ in lengths]
    cache, prev = None, 0
    for cut in [*cuts, max(lengths)]:
        pieces = [[x[i][min(prev, n) : min(cut, n)] for i, n in enumerate(lengths)] for x in per_seq]
        step_cu = torch.tensor([0, *torch.tensor([p.shape[0] for p in pieces[0]]).cumsum(0).tolist()])
        out, cache = gd.gated_delta_continue(*(torch.cat(p) for p in pieces), step_cu, cache)
        for i, o in enumerate(_split(out, step_cu.tolist())):
            outs[i].append(o)
        prev = cut
    return torch.cat([torch.cat(o) for o in outs]), cache


@pytest.mark.parametrize(
    ("dtype", "dk", "dv", "hk", "hv"),
    [
        pytest.param(torch.float32, 32, 32, 2, 2, marks=_INTERPRETED),
        (torch.bfloat16, 64, 64, 1, 2),
        (torch.float32, 24, 40, 1, 1),
    ],
)
def test_prefill_packed_chunked_and_decode_agree_bit_for_bit(dtype, dk, dv, hk, hv):
    lengths = [1, C - 1, C, C + 1, 3 * C + 5]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = _inputs(int(cu[-1]), hk, hv, dk, dv, dtype, seed=dk + hv)
    packed, state = gd.chunk_gated_delta(*inputs, cu)
    # each sequence alone
    alone = [
        gd.chunk_gated_delta(*(x[a:b] for x in inputs), torch.tensor([0, b - a])) for a, b in itertools.pairwise(cu)
    ]
    assert torch.equal(packed, torch.cat([o for o, _ in alone]))
    assert torch.equal(state, torch.cat([s for _, s in alone]))
    # chunked prefill split at several points (inside and on chunk boundaries), then decode to the end
    splits = [[5, C, C + 3, 2 * C - 1, 3 * C, 3 * C + 1]]
    if dk == 24:  # every token decoded one by one (lengths 1, C - 1, C, C + 1, 3C + 5)
        splits.append(list(range(1, 3 * C + 5)))
    elif dk == 32:  # under the interpreter: decode steps at the start and across the first boundary
        splits.append([1, 2, C - 2, C - 1, C, C + 1, C + 2])
    for cuts in splits:
        pieces, cache = _continue_in_pieces(inputs, lengths, cuts)
        assert torch.equal(pieces, packed), cuts
        assert torch.equal(cache.state, state)
    # close to the float64 recurrence
    ref = _recurrent64(*inputs, cu)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(packed.double(), ref, atol=tol, rtol=tol)


def test_negative_control_stock_chunked_and_recurrent_differ():
    """Hugging Face's own chunked and recurrent rules give different bits for the same tokens (what this
    schedule removes); and a schedule anchored elsewhere (the last token fed after a boundary state of a
    shifted chunking) gives other bits than ours."""
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta = _inputs(C + 7, 2, 2, 32, 32, torch.float32, seed=3)
    args = [x.unsqueeze(0) for x in (q, k, v, g, beta)]
    chunked, _ = qn.torch_chunk_gated_delta_rule(*args, chunk_size=C, use_qk_l2norm_in_kernel=True)
    recurrent, _ = qn.torch_recurrent_gated_delta_rule(*args, use_qk_l2norm_in_kernel=True)
    assert not torch.equal(chunked, recurrent)
    torch.testing.assert_close(chunked, recurrent, atol=1e-4, rtol=1e-4)
    cu = torch.tensor([0, C + 7])
    ours, _ = gd.chunk_gated_delta(q, k, v, g, beta, cu)
    shifted = torch.cat(
        [
            gd.chunk_gated_delta(*(x[:3] for x in (q, k, v, g, beta)), torch.tensor([0, 3]))[0],
            gd.chunk_gated_delta(
                *(x[3:] for x in (q, k, v, g, beta)),
                torch.tensor([0, C + 4]),
                # the float64 recurrence's state after 3 tokens, rounded to fp32: a boundary at 3, not 0
                _state64(q[:3], k[:3], v[:3], g[:3], beta[:3]).float(),
            )[0],
        ]
    )
    torch.testing.assert_close(shifted, ours, atol=1e-4, rtol=1e-4)
    assert not torch.equal(shifted, ours)


def _state64(q, k, v, g, beta):
    k, v, g, beta = (x.double() for x in (k, v, g, beta))
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    s = torch.zeros(v.shape[1], k.shape[2], v.shape[2], dtype=torch.float64)
    for t in range(k.shape[0]):
        s = s * g[t].exp()[:, None, None]
        delta = (v[t] - (s * k[t][:, :, None]).sum(1)) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
    return s.unsqueeze(0)


def _grads(fn, inputs, d_out, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
    (fn(*leaves) * d_out.to(dtype)).sum().backward()
    return [x.grad for x in leaves]


@pytest.mark.parametrize(
    ("dtype", "lengths", "dk", "dv", "hk", "hv", "with_state"),
    [
        (torch.float32, [C + 3, 9, 2 * C], 32, 40, 1, 2, True),
        (torch.bfloat16, [1, C + 1], 16, 32, 2, 6, False),
        (torch.float32, [3 * C + 5], 24, 32, 1, 1, False),
    ],
)
def test_backward_deterministic_and_close_to_float64_autograd(dtype, lengths, dk, dv, hk, hv, with_state):
    """The Triton backward (CPU: its replay): identical gradients run to run, close to autograd of the
    float64 recurrence (packed sequences, unaligned lengths, GQA, the initial state's gradient)."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    total = int(cu[-1])
    inputs = list(_inputs(total, hk, hv, dk, dv, dtype, seed=dk + dv))
    if with_state:
        inputs.append(torch.randn(len(lengths), hv, dk, dv, generator=torch.Generator().manual_seed(2)) * 0.1)
    d_out = torch.randn(total, hv, dv, generator=torch.Generator().manual_seed(5))

    def ours(*x):
        return gd.chunk_gated_delta(*x[:5], cu, *x[5:])[0]

    first = _grads(ours, inputs, d_out, dtype)
    second = _grads(ours, inputs, d_out, dtype)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    # the reference at the inputs' rounded values (bf16 q / k / v: the same tensors, widened)
    ref = _grads(lambda *x: _recurrent64(*x[:5], cu, *x[5:]), [x.to(dtype) for x in inputs], d_out, torch.float64)
    tol = 3e-2 if dtype == torch.bfloat16 else 2e-4
    for name, a, b in zip("q k v g beta state".split(), first, ref, strict=False):
        assert a.dtype == dtype, name
        torch.testing.assert_close(a.double(), b, atol=tol * max(1.0, b.abs().max().item()), rtol=tol, msg=name)


def test_backward_negative_control_other_reduction_order_differs(monkeypatch):
    """The run-to-run check can fail: summing dq / dk over a GQA group in descending order (another
    fixed order) changes their bits, closely."""
    from samepath.kernels import gated_delta_bwd

    cu = torch.tensor([0, 7, C + 3])
    inputs = _inputs(C + 3, 1, 3, 16, 32, torch.float32, seed=9)
    d_out = torch.randn(C + 3, 3, 32, generator=torch.Generator().manual_seed(1))

    def ours(*x):
        return gd.chunk_gated_delta(*x, cu)[0]

    first = _grads(ours, inputs, d_out, torch.float32)

    def descending(x, hk):
        x = x.view(x.shape[0], hk, -1, x.shape[2])
        acc = x[:, :, -1]
        for i in reversed(range(x.shape[2] - 1)):
            acc = acc + x[:, :, i]
        return acc.contiguous()

    monkeypatch.setattr(gated_delta_bwd, "_group_sum", descending)
    other = _grads(ours, inputs, d_out, torch.float32)
    assert torch.equal(first[2], other[2])
    torch.testing.assert_close(other[0], first[0], atol=1e-6, rtol=1e-5)
    assert not torch.equal(first[0], other[0])


@_INTERPRETED
def test_verify_replay_matches_interpreter_and_negative_control(monkeypatch):
    lengths = [C + 2, 5]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = _inputs(int(cu[-1]), 1, 2, 24, 32, torch.bfloat16, seed=7)
    state = torch.randn(2, 2, 24, 32) * 0.1
    with cpu_executor("verify"):
        gd.chunk_gated_delta(*inputs, cu, state)

    def lapack_inverse(a, eye):  # the same inverse, another reduction order
        import numpy as np

        return np.linalg.inv(eye + a).astype(np.float32)

    # the backward too (the forward rerun storing the chunk states, then the reverse walk)
    leaves = [x.detach().requires_grad_() for x in (*inputs, state)]
    with cpu_executor("verify"):
        gd.chunk_gated_delta(*leaves[:5], cu, leaves[5])[0].float().sum().backward()
    monkeypatch.setattr(gd_replay, "_ut_inverse", lapack_inverse)
    with cpu_executor("verify"), pytest.raises(ReplayMismatch, match="_gated_delta_fwd_kernel"):
        gd.chunk_gated_delta(*inputs, cu, state)


def test_bad_inputs_raise_value_error_naming_the_argument():
    q, k, v, g, beta = _inputs(10, 2, 2, 16, 16, torch.float32, seed=1)
    cu = torch.tensor([0, 10])
    with pytest.raises(ValueError, match="k must match"):
        gd.chunk_gated_delta(q, k[:, :1], v, g, beta, cu)
    with pytest.raises(ValueError, match="v's head count"):
        gd.chunk_gated_delta(q, k, v[:, :1].expand(10, 3, 16), g, beta, cu)
    with pytest.raises(ValueError, match="beta must be"):
        gd.chunk_gated_delta(q, k, v, g, beta[:, :1], cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gd.chunk_gated_delta(q, k, v, g, beta, torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="state must be"):
        gd.chunk_gated_delta(q, k, v, g, beta, cu, torch.zeros(1, 2, 16, 8))
    with pytest.raises(ValueError, match="q must be"):
        gd.chunk_gated_delta(q.long(), k, v, g, beta, cu)
    _, cache = gd.gated_delta_continue(q, k, v, g, beta, cu)
    with pytest.raises(ValueError, match="cache"):
        gd.gated_delta_continue(q, k, v, g, beta, torch.tensor([0, 5, 10]), cache)


def _feed_slots(inputs, lengths, schedule, slots, slot_ids, initial=None):
    """Feed sequence i its next ``schedule[step][i]`` tokens per step through the slot path (one call per
    step, a mixed batch); returns the outputs in packed order."""
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    per_seq = [_split(x, cu) for x in inputs]
    outs, done = [[] for _ in lengths], [0] * len(lengths)
    for step, counts in enumerate(schedule):
        pieces = [[x[i][done[i] : done[i] + c] for i, c in enumerate(counts)] for x in per_seq]
        step_cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
        out = gd.gated_delta_continue_slots(
            *(torch.cat(p) for p in pieces), step_cu, slots, slot_ids, initial if step == 0 else None
        )
        for i, o in enumerate(_split(out, step_cu.tolist())):
            outs[i].append(o)
            done[i] += counts[i]
    assert done == list(lengths)
    return torch.cat([torch.cat(o) for o in outs])


def _schedule(lengths, sizes, seed):
    """Random per-step token counts (from ``sizes``, 0 included) until every sequence is fed."""
    gen = torch.Generator().manual_seed(seed)
    left, steps = list(lengths), []
    while any(left):
        counts = [min(n, sizes[int(torch.randint(len(sizes), (1,), generator=gen))]) for n in left]
        steps.append(counts)
        left = [n - c for n, c in zip(left, counts, strict=True)]
    return steps


@pytest.mark.parametrize(
    ("dtype", "dk", "dv", "hk", "hv"),
    [(torch.float32, 32, 40, 1, 2), (torch.bfloat16, 16, 32, 2, 6)],
)
def test_slots_mixed_prefill_decode_batch_equals_one_call(dtype, dk, dv, hk, hv):
    """The slot path (vLLM's state cache): every split of every sequence, mixed in one batch with other
    sequences' prefill chunks and decode steps, token-by-token decode across a chunk boundary, gives
    the one-call prefill's outputs and states; other slots untouched; a dirty slot reused by a fresh
    sequence (``initial`` False)."""
    lengths = [1, C - 1, C, C + 1, 3 * C + 5]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = _inputs(int(cu[-1]), hk, hv, dk, dv, dtype, seed=dv + hv)
    packed, state = gd.chunk_gated_delta(*inputs, cu)
    slot_ids = torch.tensor([6, 0, 3, 5, 1])
    schedules = [
        _schedule(lengths, [0, 1, 2, 5, C - 1, C, C + 1], seed=dk),
        # prefill to C - 2, then token by token across the first boundary, then the rest in one piece
        [[min(n, C - 2) for n in lengths]]
        + [[1 if C - 2 + s < n else 0 for n in lengths] for s in range(4)]
        + [[max(0, n - C - 2) for n in lengths]],
    ]
    for schedule in schedules:
        slots = gd.GatedDeltaSlots.allocate(8, hk, hv, dk, dv, dtype)
        for buf in (slots.state, slots.tail_k, slots.tail_v, slots.tail_g, slots.tail_beta):
            buf.copy_(torch.randn(buf.shape))  # dirty slots: the fresh sequences must not read them
        slots.tail_len.fill_(7)
        before = [x.clone() for x in (slots.state, slots.tail_len)]
        out = _feed_slots(inputs, lengths, schedule, slots, slot_ids, torch.zeros(5, dtype=torch.bool))
        assert torch.equal(out, packed)
        assert torch.equal(slots.state[slot_ids], state)
        assert torch.equal(slots.tail_len[slot_ids], torch.tensor(lengths, dtype=torch.int32) % C)
        for other in (2, 4, 7):
            assert torch.equal(slots.state[other], before[0][other]) and slots.tail_len[other] == 7
    # the slot path and the packed continuation agree on the boundary tails they keep
    _, cache = gd.gated_delta_continue(*inputs, cu)
    rows = [slots.tail_k[s, : n % C] for s, n in zip(slot_ids.tolist(), lengths, strict=True)]
    assert torch.equal(torch.cat(rows), cache.k)


def test_slots_negative_control_wrong_tail_length():
    """The same harness with one slot's tail length off by one (a token dropped from the partial chunk)
    gives other bits: the equality above can fail."""
    lengths = [C + 9, 20]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = _inputs(int(cu[-1]), 1, 2, 16, 32, torch.float32, seed=4)
    packed, _ = gd.chunk_gated_delta(*inputs, cu)
    slots = gd.GatedDeltaSlots.allocate(2, 1, 2, 16, 32, torch.float32)
    slot_ids = torch.tensor([1, 0])
    first = _feed_slots(inputs, [C + 5, 15], [[C + 5, 15]], slots, slot_ids)
    slots.tail_len[1] -= 1  # the bug under test
    rest = _feed_slots(_rest(inputs, cu, [C + 5, 15]), [4, 5], [[4, 5]], slots, slot_ids)
    out = torch.cat([first[: C + 5], rest[:4], first[C + 5 :], rest[4:]])
    torch.testing.assert_close(out, packed, atol=0.5, rtol=0.5)
    assert torch.equal(out[: C + 5], packed[: C + 5])
    assert not torch.equal(out, packed)


def _rest(inputs, cu, done):
    """The tokens after the first ``done[i]`` of each sequence, packed."""
    return [
        torch.cat([x[a + d : b] for (a, b), d in zip(itertools.pairwise(cu.tolist()), done, strict=True)])
        for x in inputs
    ]


@_INTERPRETED
def test_slots_verify_replay_matches_interpreter():
    """Slot mode under ``verify``: the replay's outputs, slot states and tails equal the interpreter's
    (a continuation into a partial chunk crossing a boundary, a fresh sequence, GQA)."""
    slots = gd.GatedDeltaSlots.allocate(3, 1, 2, 24, 32, torch.bfloat16)
    slots.tail_len[2] = C - 3
    for buf in (slots.state, slots.tail_k, slots.tail_v, slots.tail_g, slots.tail_beta):
        buf.copy_(torch.randn(buf.shape) * 0.1)
    inputs = _inputs(9, 1, 2, 24, 32, torch.bfloat16, seed=8)
    with cpu_executor("verify"):
        gd.gated_delta_continue_slots(
            *inputs, torch.tensor([0, 5, 9]), slots, torch.tensor([2, 0]), torch.tensor([True, False])
        )


def test_slots_bad_inputs_raise_value_error_naming_the_argument():
    q, k, v, g, beta = _inputs(4, 1, 2, 16, 16, torch.float32, seed=1)
    cu, ids = torch.tensor([0, 4]), torch.tensor([0])
    slots = gd.GatedDeltaSlots.allocate(2, 1, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="slots must be"):
        gd.gated_delta_continue_slots(q, k, v, g, beta, cu, None, ids)
    with pytest.raises(ValueError, match="slot_ids must be"):
        gd.gated_delta_continue_slots(q, k, v, g, beta, cu, slots, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="initial must be"):
        gd.gated_delta_continue_slots(q, k, v, g, beta, cu, slots, ids, torch.tensor([1]))
    bad = gd.GatedDeltaSlots.allocate(2, 1, 2, 16, 16, torch.bfloat16)
    with pytest.raises(ValueError, match=r"slots\.tail_k must be"):
        gd.gated_delta_continue_slots(q, k, v, g, beta, cu, bad, ids)
    slots.tail_len = slots.tail_len.long()
    with pytest.raises(ValueError, match=r"slots\.tail_len must be"):
        gd.gated_delta_continue_slots(q, k, v, g, beta, cu, slots, ids)
    slots = gd.GatedDeltaSlots.allocate(2, 1, 2, 16, 16, torch.float32)
    slots.state = slots.state.transpose(2, 3)
    with pytest.raises(ValueError, match=r"slots\.state must be contiguous"):
        gd.gated_delta_continue_slots(q, k, v, g, beta, cu, slots, ids)
