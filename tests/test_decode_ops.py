"""The torch backend's decode ops (a step's few rows: TorchOps' short paths) against float64 from scratch.

The decode paths cut torch calls (issue 50): the RoPE rotation matrices from one matmul by a constant basis, q
and k of the Gated DeltaNet normed together, the causal conv as one vecdot, one sequence's state rows as views
at the slot number of the call. Each is checked here against the plain formula in float64, at batch 1
(the CPU's views) and at batch 3 (gathered rows), with GQA repeats of 1 and 2."""

import pytest
import torch
import torch.nn.functional as F

import pocketllm


def rope64(x, pos, inv_freq):
    """Rotate-half RoPE in float64 on the first 2 * len(inv_freq) dims of x (T, H, D) at positions pos (T,)."""
    r = inv_freq.numel()
    ang = (pos.float()[:, None, None] * inv_freq).double()               # (T, 1, r): fp32 angles, as the model
    x = x.double()
    x1, x2 = x[..., :r], x[..., r:2 * r]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin(), x[..., 2 * r:]], -1)


@pytest.mark.parametrize("T", [1, 3])
def test_decode_qk_norm_rope_matches_float64(T):
    """qk_norm_rope's decode path (the rotation as matrices from _rotation_basis) against the norm and RoPE in
    float64; a second step at other positions gets its own matrices (the memo follows the positions)."""
    gen = torch.Generator().manual_seed(T)
    Hq, Hk, D, eps = 4, 2, 64, 1e-6
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))     # 8 rotary pairs (partial RoPE)
    q_w, k_w = torch.randn(D, generator=gen) * 0.1, torch.randn(D, generator=gen) * 0.1
    ops = pocketllm.TorchOps()
    for positions in (torch.tensor([5, 17, 300][:T]), torch.tensor([6, 18, 301][:T])):
        q, k = torch.randn(T, Hq, D, generator=gen), torch.randn(T, Hk, D, generator=gen)
        got_q, got_k = ops.qk_norm_rope(q, k, q_w, k_w, eps, positions, inv_freq)

        def ref(x, w):
            x = x.double()
            return rope64(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.double()), positions,
                          inv_freq)
        torch.testing.assert_close(got_q.double(), ref(q, q_w), atol=2e-6, rtol=0)
        torch.testing.assert_close(got_k.double(), ref(k, k_w), atol=2e-6, rtol=0)


def test_rotation_basis_builds_the_rotation():
    """[cos | sin] @ basis is the matrix that rotates [x1 | x2] to [x1 cos - x2 sin | x2 cos + x1 sin]."""
    r = 3
    cos, sin = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.7, 0.8, 0.9])
    M = (torch.cat([cos, sin]) @ pocketllm.TorchOps._rotation_basis(r, "cpu")).view(2 * r, 2 * r)
    x = torch.randn(2 * r, generator=torch.Generator().manual_seed(0)).double()
    x1, x2 = x[:r], x[r:]
    c, s = cos.double(), sin.double()
    torch.testing.assert_close(x @ M.double(), torch.cat([x1 * c - x2 * s, x2 * c + x1 * s]), atol=1e-12, rtol=0)


def conv64(x, w, state):
    """The causal depthwise conv of one token per sequence: silu(sum over taps of [state | x] * w) in float64,
    and the state after it. x (B, C); w (C, W); state (B, C, W - 1)."""
    xs = torch.cat([state.double(), x.double()[:, :, None]], -1)          # (B, C, W)
    return F.silu((xs * w.double()).sum(-1)), xs[:, :, 1:]


def delta64(q, k, v, g, beta, S):
    """The gated delta rule for one token per sequence in float64, q and k l2-normed (q also by Dk^-0.5), value
    head h reading key head h // rep. q, k (B, Hk, Dk); v (B, Hv, Dv); g, beta (B, Hv); S (B, Hv, Dk, Dv)."""
    rep = v.shape[1] // k.shape[1]
    q, k, v, S = (t.double() for t in (q, k, v, S))
    q = (q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() * q.shape[-1] ** -0.5).repeat_interleave(rep, 1)
    k = (k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(rep, 1)
    S = S * g.double().exp()[..., None, None]
    delta = (v - torch.einsum("bhk,bhkv->bhv", k, S)) * beta.double()[..., None]
    S = S + torch.einsum("bhk,bhv->bhkv", k, delta)
    return torch.einsum("bhk,bhkv->bhv", q, S), S


@pytest.mark.parametrize("slots,Hk,Hv", [([2], 2, 4), ([2], 2, 2), ([4, 0, 3], 2, 4)])
def test_decode_conv_and_delta_rule_match_float64(slots, Hk, Hv):
    """Two decode steps of conv1d and gated_delta on state slots (one sequence: views updated in place; three:
    gathered and written back) against float64; the other slots stay untouched."""
    gen = torch.Generator().manual_seed(len(slots) * 10 + Hv)
    B, Dk, Dv, W, nslots = len(slots), 16, 8, 4, 6
    C = 2 * Hk * Dk + Hv * Dv
    w = torch.randn(C, W, generator=gen).to(torch.bfloat16)                # conv taps stored in bf16
    conv_state = torch.randn(nslots, C, W - 1, generator=gen)
    ssm = torch.randn(nslots, Hv, Dk, Dv, generator=gen) * 0.1
    conv_ref, ssm_ref = conv_state.double().clone(), ssm.double().clone()
    ids = torch.tensor(slots, dtype=torch.int32)
    ops = pocketllm.TorchOps()
    for _ in range(2):
        x = torch.randn(B, C, generator=gen)
        g, beta = -torch.rand(B, Hv, generator=gen), torch.rand(B, Hv, generator=gen)
        qkv = ops.conv1d(x, w, conv_state, ids, None)                      # (B, C)
        want_qkv, conv_ref[slots] = conv64(x, w, conv_ref[slots])
        torch.testing.assert_close(qkv.double(), want_qkv, atol=1e-5, rtol=0)
        q, k, v = qkv.split([Hk * Dk, Hk * Dk, Hv * Dv], 1)
        o = ops.gated_delta(q.view(B, Hk, Dk), k.view(B, Hk, Dk), v.view(B, Hv, Dv), g, beta, ssm, ids, None)
        want_o, ssm_ref[slots] = delta64(q.view(B, Hk, Dk), k.view(B, Hk, Dk), v.view(B, Hv, Dv), g, beta,
                                         ssm_ref[slots])
        torch.testing.assert_close(o.double(), want_o, atol=1e-5, rtol=0)
    torch.testing.assert_close(conv_state.double(), conv_ref, atol=1e-6, rtol=0)   # every slot, moved or not
    torch.testing.assert_close(ssm.double(), ssm_ref, atol=1e-5, rtol=0)


def test_a_slot_tensor_written_in_place_is_read_again():
    """One sequence's state row is a view at the slot slot_ids holds at the call: a write into that tensor (a
    reused payload) moves the next call to the new slot."""
    ops, C, W = pocketllm.TorchOps(), 4, 4
    w, state = torch.ones(C, W), torch.zeros(3, C, W - 1)
    ids = torch.tensor([1], dtype=torch.int32)
    ops.conv1d(torch.full((1, C), 2.0), w, state, ids, None)
    ids.fill_(2)
    ops.conv1d(torch.full((1, C), 3.0), w, state, ids, None)
    assert state[1, :, -1].eq(2.0).all() and state[2, :, -1].eq(3.0).all() and state[0].eq(0).all()


@pytest.mark.parametrize("T", [1, 3])
def test_decode_gated_rmsnorm_matches_float64(T):
    gen = torch.Generator().manual_seed(T)
    H, D, eps = 4, 64, 1e-6
    x, z = torch.randn(T, H, D, generator=gen), torch.randn(T, H, D, generator=gen) * 2
    w = (1 + torch.randn(D, generator=gen) * 0.1).to(torch.bfloat16)
    got = pocketllm.TorchOps().gated_rmsnorm(x, z, w, eps)
    x64 = x.double()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double() * F.silu(z.double())
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)
