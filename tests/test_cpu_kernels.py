"""The torch engine's C kernels (int8 and int4 weight formats) against plain torch references."""

from __future__ import annotations

import platform
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from backends.torch import native
from backends.torch.attention import decode_mask
from backends.torch.model import ModelSpec, Rotary, apply_rotary
from backends.torch.quantize import SMALL_BATCH, PackedLinear, pack_int4_weights, pack_weight, unpack_weight


X86 = platform.machine() in ("x86_64", "AMD64")
# The AVX2 build is the native one where the CPU has no AVX-512 VNNI.
BUILDS = ["native"] + (["portable"] if X86 else []) + (["avx2"] if X86 and native.kernels().simd == 2 else [])
PORTABLE = {"portable": (("-march=x86-64",), 0), "avx2": (("-march=x86-64-v3",), 1),
            "avx-vnni": (("-march=x86-64-v3", "-mavxvnni"), 1)}


def cpu_has(flag: str) -> bool:
    """Whether this machine's CPU lists ``flag`` (Linux's /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and flag in line.split() for line in text.splitlines())


def portable_build(tmp_path_factory, name: str):
    flags, simd = PORTABLE[name]
    path = tmp_path_factory.mktemp(name) / "cpu_kernels.so"
    native.compile_library(path, native._compiler(), ("-O2", *flags, "-ffp-contract=off", "-shared", "-fPIC"))
    built = native.load(path)
    assert built.simd == simd
    return built


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory):
    """The library for AVX2 alone (built once for the module)."""
    return portable_build(tmp_path_factory, "avx2")


@pytest.fixture(scope="module", params=BUILDS)
def k(request, tmp_path_factory):
    """The library as the engine builds it (-march=native: AVX-512 VNNI here), a build for AVX2
    alone, and one for plain x86-64, whose other loops must compute the same."""
    if request.param == "native":
        return native.kernels()
    if request.param == "avx2":
        return request.getfixturevalue("avx2_build")
    return portable_build(tmp_path_factory, request.param)


def linear_with(k, lin: PackedLinear, x: torch.Tensor, out: torch.Tensor | None = None, accumulate=False):
    """``lin``'s packed weights through the library ``k`` (its rows quantized by ``k`` too)."""
    q, dq = int16_rows(k, x, lin.padded_in_features)
    out = torch.empty(x.shape[0], lin.out_features) if out is None else out
    xsum = torch.empty(x.shape[0] * lin.padded_in_features // lin.group)
    weight, bias = lin.pointers
    k.linear(
        q.data_ptr(), dq.data_ptr(), x.shape[0], lin.padded_in_features, weight, lin.group, lin.bits, bias,
        lin.out_features, out.data_ptr(), out.stride(0), int(accumulate), xsum.data_ptr(),
    )
    return out


def int16_rows(k, x: torch.Tensor, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.shape
    q = torch.empty(m, kp, dtype=torch.int16)
    dq = torch.empty(m)
    k.quantize_rows(x.data_ptr(), m, n, x.stride(0), kp, q.data_ptr(), dq.data_ptr())
    return q, dq


def test_the_library_is_built_once_and_reused(monkeypatch):
    k = native.kernels()
    assert k.path.is_file() and k.path.stat().st_mode & 0o755 == 0o755
    monkeypatch.setattr(native, "_loaded", None)

    def no_compiling(*args, **kwargs):
        raise AssertionError("rebuilt although the cache has the library")

    monkeypatch.setattr(native.subprocess, "run", no_compiling)
    assert native.kernels().path == k.path


def test_a_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(native.NativeKernelsUnavailable, match="needs a C compiler"):
        native._compiler()


def test_kernels_use_torch_thread_count():
    k = native.kernels()
    seen = {}

    def probe():
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        seen["one"] = k.threads()
        torch.set_num_threads(2)
        seen["two"] = k.threads()
        torch.set_num_threads(before)

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert seen == {"one": 1, "two": 2}


@pytest.mark.parametrize("shape", [(1, 16), (7, 33), (5, 100), (64, 576)])
def test_row_quantization_keeps_every_value_to_its_rows_scale(k, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape) * torch.logspace(-3, 3, shape[0])[:, None]
    x[0, 0] = 0.0
    kp = -(-shape[1] // 32) * 32
    q, dq = int16_rows(k, x, kp)
    assert q[:, shape[1] :].eq(0).all()
    assert torch.allclose(dq, x.abs().amax(1) / 32767)
    err = (q[:, : shape[1]].double() * dq[:, None].double() - x.double()).abs()
    assert (err <= dq[:, None] * 0.5001 + x.abs() * 1e-6).all()
    assert q.abs().max() == 32767


def test_a_zero_row_quantizes_to_zeros(k):
    q, dq = int16_rows(k, torch.zeros(2, 32), 32)
    assert q.eq(0).all() and dq.eq(1.0).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,kin", [(4, 32), (5, 40), (576, 576), (30, 1536), (3, 7)])
def test_packing_round_trips_within_half_a_step(n, kin, bits):
    torch.manual_seed(1)
    w = torch.randn(n, kin) * torch.rand(n, 1) * 3 + torch.rand(n, 1)
    packed = pack_weight(w, bits, 32)
    groups = -(-kin // 32)
    assert packed.dtype == torch.uint8 and packed.shape == (-(-n // 8), groups, 64 + bits * 32)
    back = unpack_weight(packed, bits, n, kin)
    assert back.shape == w.shape
    padded = torch.zeros(n, groups * 32)
    padded[:, :kin] = w
    g = padded.view(n, groups, 32)
    step = ((g.amax(-1) - g.amin(-1)) / (2**bits - 1)).repeat_interleave(32, dim=1)[:, :kin]
    assert ((back - w).abs() <= step * 0.5 + 1e-5).all()
    # every group's extremes are levels 0 and 2**bits - 1: the full range is used
    if kin % 32 == 0:
        for red in (torch.amin, torch.amax):
            torch.testing.assert_close(red(back.view(n, groups, 32), -1), red(g, -1), rtol=0, atol=1e-5)


def gguf_blocks(kind: str, levels: range, seed: int, rows: int = 16, groups: int = 4) -> torch.Tensor:
    """Weights as a GGUF file dequantizes them: per 32, float16 ``d`` (and ``m``) and integer ``q``,
    with the levels each quantizer gives a block's extremes (Q4_1: 0 and 15, Q4_0: -8, Q8_0: +-127)."""
    torch.manual_seed(seed)
    d = (torch.rand(rows, groups, 1) * 0.1 + 1e-3).half().float()
    q = torch.randint(levels.start, levels.stop, (rows, groups, 32)).float()
    if kind == "Q4_1":
        q[..., 0], q[..., 1] = 0, 15
        m = -torch.rand(rows, groups, 1).half().float()
        return (d * q + m).view(rows, groups * 32)
    if kind == "Q4_0":
        q[..., 0] = -8
    elif kind == "Q8_0":
        q[..., 0] = 127 * (torch.randint(0, 2, (rows, groups)) * 2 - 1)
    return (d * q).view(rows, groups * 32)


@pytest.mark.parametrize(
    "kind,bits,levels",
    [
        ("Q4_1", 4, range(0, 16)),
        ("Q4_1", 8, range(0, 16)),
        ("Q4_0", 4, range(-8, 8)),
        ("Q4_0", 4, range(-8, 0)),  # blocks whose levels stop short of the top
        ("some 4-bit grid", 4, range(2, 13)),  # neither extreme level used
        ("Q8_0", 8, range(-127, 128)),
        ("Q8_0", 8, range(-20, 41)),  # small weights around the one at +-127
        ("some 8-bit grid", 8, range(-60, 61)),  # the smallest gap decides
    ],
)
def test_gguf_blocks_are_reproduced_exactly(kind, bits, levels):
    w = gguf_blocks(kind, levels, seed=bits + levels.start)
    back = unpack_weight(pack_weight(w, bits, 32), bits, 16, 128)
    torch.testing.assert_close(back, w, rtol=0, atol=2e-6)


def test_float_weights_are_not_mistaken_for_a_grid():
    # Random floats lie on no coarse grid: each group spans the format's full 15 or 255 steps.
    torch.manual_seed(3)
    w = torch.randn(64, 256)
    for bits in (4, 8):
        packed = pack_weight(w, bits, 32)
        scale = packed[..., : 8 * 8].contiguous().view(torch.float32)[..., :8]  # [tiles, groups, channel]
        span = w.view(8, 8, 8, 32).amax(-1) - w.view(8, 8, 8, 32).amin(-1)  # [tiles, channel, groups]
        torch.testing.assert_close(scale, span.transpose(1, 2) / (2**bits - 1))


def reference_linear(k, lin: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """What the kernel must compute: the quantized rows times the dequantized weights."""
    q, dq = int16_rows(k, x, lin.padded_in_features)
    w = lin.weight()
    out = (q[:, : lin.in_features].double() * dq[:, None].double()) @ w.double().T
    if lin._bias is not None:
        out += lin._bias.double()
    return out.float()


@pytest.mark.parametrize("bits", [8, 4])
# From 16 rows the AVX2 build takes its wide loop (two rows at a time: 17 and 33 leave one), a
# VNNI build six at a time (16, 17 and 33 leave 4, 5 and 3).
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 17, 33])
# Tiles of 8 channels go in pairs in the AVX2 wide loop, in fours in the VNNI one: 1, 2 (the
# second partial) and 17 tiles.
@pytest.mark.parametrize("n,kin,bias", [(4, 32, False), (9, 48, True), (576, 576, False), (130, 1536, True), (1, 16, True)])
def test_linear_matches_its_reference(k, m, n, kin, bias, bits):
    torch.manual_seed(m * 1000 + n)
    lin = PackedLinear(torch.nn.Linear(kin, n, bias=bias), bits)
    x = torch.randn(m, kin)
    got = linear_with(k, lin, x)
    want = reference_linear(k, lin, x)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    module = lin(x) if m <= SMALL_BATCH else lin.kernel_forward(x)  # the engine's build
    torch.testing.assert_close(module, got, rtol=1e-5, atol=1e-5)
    # And close to the float layer it replaced (the weights are packed now).
    float_out = F.linear(x, lin.weight(), lin._bias)
    torch.testing.assert_close(got, float_out, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [3, 20])
def test_linear_accumulates_into_a_strided_output(k, bits, m):
    torch.manual_seed(3)
    lin = PackedLinear(torch.nn.Linear(64, 10, bias=True), bits)
    x = torch.randn(m, 64)
    base = torch.randn(m, 16)
    out = base.clone()
    linear_with(k, lin, x, out[:, 2:12], accumulate=True)
    torch.testing.assert_close(out[:, 2:12], base[:, 2:12] + reference_linear(k, lin, x), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, :2], base[:, :2]) and torch.equal(out[:, 12:], base[:, 12:])


def test_group_sizes_and_widths_the_kernel_cannot_take_are_refused():
    with pytest.raises(ValueError, match="multiple of 16 from 16 to 256"):
        pack_weight(torch.randn(8, 512), 8, 512)
    with pytest.raises(ValueError, match="multiple of 16 from 16 to 256"):
        pack_weight(torch.randn(8, 48), 8, 24)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        pack_weight(torch.randn(8, 32), 2)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_row_gets_the_same_bits_whatever_the_batch(k, bits):
    # The engine relies on it: a sequence's tokens must not depend on how many others decode in
    # the same step, though batches of 16 rows and more take the kernel's other loop.
    torch.manual_seed(5)
    lin = PackedLinear(torch.nn.Linear(576, 130, bias=True), bits)
    x = torch.randn(41, 576)
    together = linear_with(k, lin, x)
    for start, rows in ((0, 1), (3, 2), (8, 8), (16, 16), (5, 33)):
        assert torch.equal(linear_with(k, lin, x[start : start + rows]), together[start : start + rows])


@pytest.mark.skipif("avx2" not in BUILDS, reason="the native build has no VNNI loop")
@pytest.mark.parametrize("bits", [8, 4])
def test_the_vnni_loop_gives_the_avx2_loops_bits(avx2_build, bits):
    # Same products, exact int32 sums, the same float steps in the same order: a model's tokens
    # do not depend on which of the two machines served them.
    avx2 = avx2_build
    torch.manual_seed(6)
    lin = PackedLinear(torch.nn.Linear(1536, 130, bias=True), bits)
    x = torch.randn(41, 1536)
    for rows in (1, 8, 16, 23, 41):
        assert torch.equal(linear_with(native.kernels(), lin, x[:rows]), linear_with(avx2, lin, x[:rows]))


@pytest.mark.skipif(not (X86 and cpu_has("avx_vnni")), reason="the CPU has no AVX-VNNI")
@pytest.mark.parametrize("bits", [8, 4])
def test_the_avx_vnni_loops_give_the_avx2_loops_bits(avx2_build, tmp_path_factory, bits):
    # AVX-VNNI (the 256-bit vpdpwssd of Intel's client cores, which lack AVX-512) replaces each
    # vpmaddwd and add of the AVX2 narrow loop (1, 3 and 8 rows here; from 16 both builds take
    # the same wide loop): exact int32 sums, the same bits.
    vnni = portable_build(tmp_path_factory, "avx-vnni")
    assert vnni.avx_vnni and not avx2_build.avx_vnni
    torch.manual_seed(7)
    lin = PackedLinear(torch.nn.Linear(1536, 130, bias=True), bits)
    x = torch.randn(41, 1536)
    for rows in (1, 3, 8, 16, 17, 41):
        assert torch.equal(linear_with(vnni, lin, x[:rows]), linear_with(avx2_build, lin, x[:rows]))


@pytest.mark.parametrize("bits", [8, 4])
def test_large_batches_use_the_same_packed_values(bits):
    torch.manual_seed(4)
    lin = PackedLinear(torch.nn.Linear(96, 40, bias=True), bits, fp16_copy=True)
    x = torch.randn(20, 96)  # above SMALL_BATCH: the fp16 copy of the packed weights
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight(), lin._bias), rtol=2e-3, atol=2e-3)
    assert not torch.equal(lin(x), lin.kernel_forward(x))  # float16 rounding: not the C kernel's bits


def test_the_fp16_copy_is_kept_only_without_the_vnni_loop():
    lin = PackedLinear(torch.nn.Linear(96, 40), 4)
    assert (lin._fp16 is not None) == (native.kernels().simd < 2)
    if lin._fp16 is None:  # every batch in C, bit for bit what its rows give alone
        x = torch.randn(20, 96)
        assert torch.equal(lin(x), lin.kernel_forward(x))
        assert torch.equal(lin(x)[:3], lin(x[:3]))


def test_int4_keeps_the_lm_head_at_8_bits():
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(32, 16)
    model.lm_head = torch.nn.Linear(32, 40, bias=False)
    pack_int4_weights(model)
    assert (model.proj.bits, model.lm_head.bits) == (4, 8)


@pytest.mark.parametrize("m,n", [(1, 64), (3, 576), (2, 37)])
def test_rmsnorm_quantize(k, m, n):
    torch.manual_seed(n)
    x, weight = torch.randn(m, n) * 5, torch.rand(n) + 0.5
    kp = -(-n // 32) * 32
    q = torch.empty(m, kp, dtype=torch.int16)
    dq, tmp = torch.empty(m), torch.empty(n)
    k.rmsnorm_quantize(x.data_ptr(), m, n, n, weight.data_ptr(), 1e-5, tmp.data_ptr(), kp, q.data_ptr(), dq.data_ptr())
    want = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(q[:, :n].float() * dq[:, None], want, rtol=0, atol=float(dq.max()) * 0.51 + 1e-5)


def test_silu_mul_quantize(k):
    torch.manual_seed(5)
    m, inter = 3, 80
    gu = torch.randn(m, 2 * inter) * 3
    kp = 96
    q = torch.empty(m, kp, dtype=torch.int16)
    dq, tmp = torch.empty(m), torch.empty(inter)
    k.silu_mul_quantize(gu.data_ptr(), m, inter, 2 * inter, tmp.data_ptr(), kp, q.data_ptr(), dq.data_ptr())
    want = F.silu(gu[:, :inter]) * gu[:, inter:]
    torch.testing.assert_close(q[:, :inter].float() * dq[:, None], want, rtol=0, atol=float(dq.max()) * 0.51 + 1e-5)
    assert q[:, inter:].eq(0).all()


def test_gelu_tanh_mul_quantize(k):
    """GeGLU (Gemma): gelu(gate, approximate="tanh") * up, written as SiLU's form (see the C
    comment); the float row before quantizing (``tmp``, the last row's) within a few float32
    ulps of torch's, the vector loop (the first 80) and the scalar tail (the last 3) alike, also
    where the exponential saturates. Below about -5 torch's 1 + tanh(u) cancels to 0 where this
    form keeps a value under 2e-7: the absolute tolerance."""
    torch.manual_seed(6)
    inter, kp = 83, 96
    gate = torch.cat([torch.randn(3, inter) * 3, torch.linspace(-60, 60, inter)[None], torch.full((1, inter), -1e4)])
    gate[4, ::2] = 1e4
    up = torch.randn(gate.shape[0], inter)
    for row in range(gate.shape[0]):
        gu = torch.cat([gate[row], up[row]])[None].contiguous()
        q = torch.empty(1, kp, dtype=torch.int16)
        dq, tmp = torch.empty(1), torch.empty(inter)
        k.gelu_tanh_mul_quantize(gu.data_ptr(), 1, inter, 2 * inter, tmp.data_ptr(), kp, q.data_ptr(), dq.data_ptr())
        want = F.gelu(gate[row], approximate="tanh") * up[row]
        torch.testing.assert_close(tmp, want, rtol=2e-6, atol=2e-7)
        torch.testing.assert_close(q[0, :inter].float() * dq, want, rtol=0, atol=float(dq) * 0.51 + 1e-5)
        assert q[0, inter:].eq(0).all()


KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_cache_written(k_cache, ref_k, v_cache, ref_v):
    """Keys and values as the torch path writes them: float32 within rotary's rounding (C rotates
    in its own order), a 16-bit cache bit for bit (the same rounding of the same floats)."""
    if k_cache.dtype == torch.float32:
        torch.testing.assert_close(k_cache, ref_k, rtol=1e-5, atol=1e-5)
        assert torch.equal(v_cache, ref_v)
    else:
        assert torch.equal(v_cache.view(torch.int16), ref_v.view(torch.int16))
        # A rotated key may sit a float32 ulp from a rounding boundary: at most one step apart.
        steps = (k_cache.view(torch.int16).int() - ref_k.view(torch.int16).int()).abs()
        assert int(steps.max()) <= 1 and float((steps > 0).float().mean()) < 0.01


def spec(heads: int, kv_heads: int, dim: int, window: int | None) -> ModelSpec:
    return ModelSpec(
        vocab_size=10, hidden_size=heads * dim, intermediate_size=8, num_layers=1, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=dim, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position=256, tie_word_embeddings=False, qkv_bias=False, mlp_bias=False, sliding_window=window,
    )


@pytest.mark.parametrize(
    "heads,kv_heads,dim,bs,lengths",
    [
        (9, 3, 64, 16, [100]),  # SmolLM2's shape, one sequence
        (4, 2, 16, 4, [1, 7, 13]),  # ragged batch, block boundaries, a first token
        (4, 4, 8, 1, [5, 2]),  # no GQA, one-token blocks
        (6, 2, 32, 8, [30, 9, 17, 8]),  # four sequences
    ],
)
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_decode_attention_matches_rotary_cache_write_and_sdpa(k, heads, kv_heads, dim, bs, window, lengths, kv):
    torch.manual_seed(len(lengths) * 100 + dim)
    s = spec(heads, kv_heads, dim, window)
    rotary = Rotary(s, 256)
    m = len(lengths)
    blocks_per_seq = [-(-n // bs) for n in lengths]
    perm = torch.randperm(sum(blocks_per_seq) + 3).tolist()  # blocks scattered over the cache
    tables, at = [], 0
    for b in blocks_per_seq:
        tables.append(perm[at : at + b])
        at += b
    slots = (sum(blocks_per_seq) + 3) * bs
    k_cache, v_cache = torch.randn(slots, kv_heads, dim).to(kv), torch.randn(slots, kv_heads, dim).to(kv)
    positions = torch.tensor([n - 1 for n in lengths])
    slot = torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, positions.tolist())])
    qkv = torch.randn(m, (heads + 2 * kv_heads) * dim)

    # Reference: the model's torch path (rotary, cache write, gather, masked SDPA).
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    cos, sin = rotary.tables(positions, torch.float32)
    qk = apply_rotary(qkv[:, : (heads + kv_heads) * dim].view(m, -1, dim), cos, sin, dim // 2)
    q, new_k = qk[:, :heads], qk[:, heads:]
    new_v = qkv[:, (heads + kv_heads) * dim :].view(m, kv_heads, dim)
    ref_k.index_copy_(0, slot, new_k.to(kv))
    ref_v.index_copy_(0, slot, new_v.to(kv))
    context = max(lengths)
    width = max(blocks_per_seq)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    idx = (table_t[:, :, None] * bs + torch.arange(bs)).view(m, -1)[:, :context]
    keys = ref_k[idx.reshape(-1)].float().view(m, context, kv_heads, dim).transpose(1, 2)
    values = ref_v[idx.reshape(-1)].float().view(m, context, kv_heads, dim).transpose(1, 2)
    mask = decode_mask(torch.tensor(lengths), context, window)
    want = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=dim**-0.5, enable_gqa=True)
    want = want.squeeze(2).reshape(m, heads * dim)

    out = torch.empty(m, heads * dim)
    len_t, tab_of = torch.tensor(lengths), torch.arange(m)
    assert k.decode_attention(
        qkv.data_ptr(), m, qkv.shape[1], heads, kv_heads, dim, positions.data_ptr(),
        rotary.cos.data_ptr(), rotary.sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slot.data_ptr(), table_t.data_ptr(), width, tab_of.data_ptr(), len_t.data_ptr(), bs, window or 0,
        dim**-0.5, 0.0, context, native.KV_KINDS[kv], out.data_ptr(),
    )
    assert_cache_written(k_cache, ref_k, v_cache, ref_v)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "heads,kv_heads,dim,bs,sequences",
    [
        # (cached positions, new tokens) per sequence: a decoding one, a chunk after a cached
        # prefix that crosses blocks, a whole short prompt.
        (4, 2, 16, 4, [(8, 1), (5, 8), (0, 4)]),
        (9, 3, 64, 16, [(0, 40), (33, 1), (20, 17)]),  # SmolLM2's shape
        (4, 4, 8, 1, [(3, 3)]),  # no GQA, one-token blocks, a chunk alone
    ],
)
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_step_attention_is_causal_within_prompt_chunks(k, heads, kv_heads, dim, bs, window, sequences, kv, softcap):
    """A prompt chunk is a row per token over one shared block table: each token attends to the
    cached prefix and to the chunk's tokens up to itself, whatever the other rows of the step.
    ``softcap``: Gemma 2's cap on the scores (1.5: most of these scores are capped hard)."""
    torch.manual_seed(dim + len(sequences))
    rotary = Rotary(spec(heads, kv_heads, dim, window), 256)
    blocks_per_seq = [-(-(c + n) // bs) for c, n in sequences]
    perm = torch.randperm(sum(blocks_per_seq) + 2).tolist()  # blocks scattered over the cache
    tables, at = [], 0
    for b in blocks_per_seq:
        tables.append(perm[at : at + b])
        at += b
    width = max(blocks_per_seq)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots = (sum(blocks_per_seq) + 2) * bs
    k_cache, v_cache = torch.randn(slots, kv_heads, dim).to(kv), torch.randn(slots, kv_heads, dim).to(kv)
    positions, tab_of = [], []
    for j, (cached, n) in enumerate(sequences):
        positions += range(cached, cached + n)
        tab_of += [j] * n
    slot_of = lambda j, p: tables[j][p // bs] * bs + p % bs  # noqa: E731
    slot = torch.tensor([slot_of(j, p) for j, p in zip(tab_of, positions)])
    m = len(positions)
    qkv = torch.randn(m, (heads + 2 * kv_heads) * dim)

    # Reference: rotate, write every new key and value, then each row on its own with softmax.
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    pos_t = torch.tensor(positions)
    cos, sin = rotary.tables(pos_t, torch.float32)
    qk = apply_rotary(qkv[:, : (heads + kv_heads) * dim].view(m, -1, dim), cos, sin, dim // 2)
    ref_k.index_copy_(0, slot, qk[:, heads:].to(kv))
    ref_v.index_copy_(0, slot, qkv[:, (heads + kv_heads) * dim :].view(m, kv_heads, dim).to(kv))
    want = torch.empty(m, heads, dim)
    for r, (j, p) in enumerate(zip(tab_of, positions)):
        first = max(0, p + 1 - window) if window else 0
        seen = torch.tensor([slot_of(j, i) for i in range(first, p + 1)])
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            scores = ref_k[seen, kvh].float() @ qk[r, h] * dim**-0.5
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            want[r, h] = torch.softmax(scores, dim=0) @ ref_v[seen, kvh].float()

    out = torch.empty(m, heads * dim)
    lengths = torch.tensor(positions) + 1
    tab_t = torch.tensor(tab_of)
    assert k.decode_attention(
        qkv.data_ptr(), m, qkv.shape[1], heads, kv_heads, dim, pos_t.data_ptr(),
        rotary.cos.data_ptr(), rotary.sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slot.data_ptr(), table_t.data_ptr(), width, tab_t.data_ptr(), lengths.data_ptr(), bs, window or 0,
        dim**-0.5, softcap or 0.0, int(lengths.max()), native.KV_KINDS[kv], out.data_ptr(),
    )
    assert_cache_written(k_cache, ref_k, v_cache, ref_v)
    torch.testing.assert_close(out, want.view(m, heads * dim), rtol=1e-4, atol=1e-5)


def rounding_cases() -> torch.Tensor:
    """Floats that probe float16 and bfloat16 rounding: ties either way, the edges of the
    subnormal and normal ranges, overflow, infinities, NaN, and a spread over 45 octaves."""
    t = 2.0**-11  # half a float16 step at 1
    b = 2.0**-8  # half a bfloat16 step at 1
    edges = [
        0.0, -0.0, 1.0, 1 + t, 1 + 3 * t, 1 + t + 2**-20, -(1 + 3 * t), 1 + b, 1 + 3 * b, 1 + b + 2**-20,
        65504.0, 65519.99, 65520.0, 1e5, -1e5, 3.39e38, 3.4028235e38, float("inf"), float("-inf"), float("nan"),
        2.0**-14, 2.0**-14 - 2.0**-25, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-26, 1e-8, -3e-6, 1e-30, 6.1e-5,
        1.4e-45, 1.17e-38,
    ]
    g = torch.Generator().manual_seed(7)
    spread = torch.exp(torch.empty(2000).uniform_(-30, 15, generator=g)) * torch.randn(2000, generator=g).sign()
    return torch.cat([torch.tensor(edges), spread])


@pytest.mark.parametrize("kv", [torch.float16, torch.bfloat16])
def test_16_bit_caches_round_as_torch_does(k, kv):
    """Values pass into the cache unrotated; each must land as torch's ``.to()`` rounds it."""
    values = rounding_cases()
    dim = 8
    m = -(-len(values) // dim)
    v = torch.zeros(m * dim)
    v[: len(values)] = values
    qkv = torch.zeros(m, 3 * dim)
    qkv[:, 2 * dim :] = v.view(m, dim)
    positions, lengths = torch.zeros(m, dtype=torch.long), torch.ones(m, dtype=torch.long)
    cos, sin = torch.ones(1, dim), torch.zeros(1, dim)
    k_cache, v_cache = torch.zeros(m, 1, dim, dtype=kv), torch.zeros(m, 1, dim, dtype=kv)
    rows = torch.arange(m)
    table = rows.view(m, 1).contiguous()  # one-slot blocks, a block per row
    out = torch.empty(m, dim)
    assert k.decode_attention(
        qkv.data_ptr(), m, 3 * dim, 1, 1, dim, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), rows.data_ptr(), table.data_ptr(), 1, rows.data_ptr(),
        lengths.data_ptr(), 1, 0, dim**-0.5, 0.0, 1, native.KV_KINDS[kv], out.data_ptr(),
    )
    got, want = v_cache.view(-1), v.to(kv)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    # Read back, every finite value is its rounding widened: the attention over one position
    # returns the value itself.
    finite = v.view(m, dim).isfinite().all(dim=1) & want.view(m, dim).isfinite().all(dim=1)
    assert torch.equal(out[finite], want.view(m, dim)[finite].float())


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_a_rows_attention_has_the_same_bits_alone_and_in_a_batch(k, kv, window):
    """Alone, a row's heads go to the threads one by one; in a batch, a row's heads on one KV
    head go together (one read of its keys and values serves them all). Each head's sums are the
    same in the same order either way, so a token's output does not depend on what else the step
    holds: decoding rows and prompt chunks' rows alike."""
    torch.manual_seed(3)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    # (cached positions, new tokens): a 40-token prompt, decoding rows, a chunk after a prefix
    # that ends mid-block, a one-token chunk.
    sequences = [(0, 40), (99, 1), (20, 17), (4, 1), (63, 12)]
    rotary = Rotary(spec(heads, kv_heads, dim, window), 256)
    per_seq = [-(-(c + n) // bs) for c, n in sequences]
    width = max(per_seq)
    perm = torch.randperm(sum(per_seq)).tolist()
    tables = [perm[sum(per_seq[:i]) : sum(per_seq[: i + 1])] for i in range(len(sequences))]
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    k_cache = torch.randn(sum(per_seq) * bs, kv_heads, dim).to(kv)
    v_cache = torch.randn(sum(per_seq) * bs, kv_heads, dim).to(kv)
    of = [j for j, (c, n) in enumerate(sequences) for _ in range(n)]
    positions = torch.tensor([p for c, n in sequences for p in range(c, c + n)])
    slot = torch.tensor([tables[j][p // bs] * bs + p % bs for j, p in zip(of, positions.tolist())])
    qkv = torch.randn(len(of), (heads + 2 * kv_heads) * dim)

    def attention(rows: list[int]) -> torch.Tensor:
        x, pos, sl = qkv[rows].clone(), positions[rows].clone(), slot[rows].clone()
        lens, tab_of = pos + 1, torch.tensor([of[r] for r in rows])
        out = torch.empty(len(rows), heads * dim)
        assert k.decode_attention(
            x.data_ptr(), len(rows), x.shape[1], heads, kv_heads, dim, pos.data_ptr(), rotary.cos.data_ptr(),
            rotary.sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), sl.data_ptr(), table.data_ptr(), width,
            tab_of.data_ptr(), lens.data_ptr(), bs, window or 0, dim**-0.5, 0.0, int(lens.max()), native.KV_KINDS[kv],
            out.data_ptr(),
        )
        return out

    together = attention(list(range(len(of))))  # also writes every new key and value
    for i in range(len(of)):
        assert torch.equal(attention([i])[0], together[i]), i
