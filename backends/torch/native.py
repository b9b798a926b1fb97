"""The engine's C kernels (``csrc/cpu_kernels.c``): built once per machine, loaded with ctypes.

The library is compiled by the system C compiler (``$CC``, else ``cc``, ``gcc``, ``clang``) with
``-O3 -march=native -ffp-contract=off -fopenmp`` into the router's cache directory, under a name
derived from the source, the flags and the CPU, so an upgrade or another machine sharing the cache
builds its own copy; later loads take milliseconds. torch is imported first: its bundled ``libgomp.so.1`` is then
the OpenMP runtime the library binds to (same soname), so both share one thread pool and
``torch.set_num_threads`` governs the kernels too.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch  # loaded before the library on purpose: see the module docstring

from .loader import cache_dir

log = logging.getLogger("router.torch")

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
ABI = 22
# No contraction of a * b + c into one fused operation where the source does not ask for it: GCC
# fuses or not depending on how it vectorizes a loop, and a row must get the same bits whichever
# of the kernel's loops (batch sizes) computed it.
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")
_P, _I = ctypes.c_void_p, ctypes.c_int64


class RkExpert(ctypes.Structure):
    """``rk_expert``: one expert's packed gate_up and down, and their biases (0: none)."""

    _fields_ = [("gate_up", _P), ("down", _P), ("gate_up_bias", _P), ("down_bias", _P)]


class RkLayer(ctypes.Structure):
    """``rk_layer``: one decoder layer's weights for ``rk_decode_step`` (pointers as integers)."""

    _fields_ = [
        ("ln1", _P), ("ln2", _P), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("ln1_bias", _P), ("ln2_bias", _P),
        ("qkv", _P), ("o", _P), ("gate_up", _P), ("down", _P),
        ("qkv_bias", _P), ("o_bias", _P), ("gate_up_bias", _P), ("down_bias", _P),
        ("qkv_kp", _I), ("o_kp", _I), ("gate_up_kp", _I), ("down_kp", _I),
        ("k_cache", _P), ("v_cache", _P),
        ("window", _I), ("q_norm", _P), ("k_norm", _P), ("qk_eps", ctypes.c_float),
        ("qk_norm_whole", ctypes.c_int),
        ("cos", _P), ("sin", _P), ("attn_out_norm", _P), ("mlp_out_norm", _P), ("out_eps", ctypes.c_float),
        ("sinks", _P),
        ("router", _P), ("router_bias", _P), ("experts", ctypes.POINTER(RkExpert)), ("shared", ctypes.POINTER(RkExpert)),
        ("num_experts", _I), ("top_k", _I), ("expert_inter", _I), ("expert_gate_up_kp", _I), ("expert_down_kp", _I),
        ("routing", ctypes.c_int), ("clamp_alpha", ctypes.c_float), ("clamp_limit", ctypes.c_float),
        ("shared_gate", _P), ("shared_inter", _I), ("shared_gate_up_kp", _I), ("shared_down_kp", _I),
        ("sigmoid", ctypes.c_int), ("choice_bias", _P), ("n_group", _I), ("topk_group", _I),
        ("routed_scale", ctypes.c_float),
        ("conv_taps", _P), ("conv_bias", _P), ("conv_kernel", _I), ("qk_norm_after_rotary", ctypes.c_int),
    ]


class RkLora(ctypes.Structure):
    """``rk_lora``: one part of a LoRA adapter of one projection (``a`` 0: no such part)."""

    _fields_ = [("a", _P), ("bt", _P), ("rank", _I), ("first", _I), ("span", _I)]



class RkModel(ctypes.Structure):
    """``rk_model``: a whole model's shapes and weights for ``rk_decode_step``."""

    _fields_ = [
        ("num_layers", _I), ("hidden", _I), ("inter", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
        ("group", _I), ("vocab", _I), ("block_size", _I),
        ("scale", ctypes.c_float), ("final_eps", ctypes.c_float), ("softcap", ctypes.c_float),
        ("residual_scale", ctypes.c_float), ("q_scales", _P), ("act", ctypes.c_int),
        ("layers", ctypes.POINTER(RkLayer)),
        ("final_norm", _P),
        ("lm_head", _P), ("lm_head_kp", _I),
        ("bits", ctypes.c_int), ("lm_head_bits", ctypes.c_int), ("kv_kind", ctypes.c_int),
        ("lora", ctypes.POINTER(RkLora)), ("num_adapters", _I), ("head_gates", ctypes.c_int),
        ("centered", ctypes.c_int), ("final_norm_bias", _P), ("lm_head_bias", _P), ("parallel", ctypes.c_int),
        ("clip_qkv", ctypes.c_float), ("alibi", _P),
    ]


KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
"""The KV cache element types the kernels read and write (``kv_kind`` in C)."""


class NativeKernelsUnavailable(RuntimeError):
    """The C kernels could not be built on this machine (no compiler, or it failed)."""


class CpuKernels:
    """Typed entry points of the built library. Pointers are ``tensor.data_ptr()`` integers."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        if lib.rk_abi() != ABI:
            raise NativeKernelsUnavailable(f"{path} has ABI {lib.rk_abi()}, expected {ABI}")
        self.threads = lib.rk_threads
        # LoRA: parts per projection and adapter (rk_lora entries), and the most rank of a part.
        self.lora_parts, self.lora_rank = lib.rk_lora_parts(), lib.rk_lora_rank()
        self.simd = lib.rk_simd()  # 0 scalar, 1 AVX2, 2 AVX2 and AVX-512 VNNI
        self.avx_vnni = bool(lib.rk_avx_vnni())  # the AVX2 narrow loop multiply-adds with AVX-VNNI (256-bit)
        self.quantize_rows = lib.rk_quantize_rows
        self.quantize_rows.argtypes = [_P, _I, _I, _I, _I, _P, _P]
        self.quantize_rows.restype = None
        self.linear = lib.rk_linear
        self.linear.argtypes = [_P, _P, _I, _I, _P, _I, ctypes.c_int, _P, _I, _P, _I, ctypes.c_int, _P]
        self.linear.restype = None
        self.rmsnorm_quantize = lib.rk_rmsnorm_quantize
        self.rmsnorm_quantize.argtypes = [_P, _I, _I, _I, _P, ctypes.c_float, _P, _I, _P, _P]
        self.rmsnorm_quantize.restype = None
        self.silu_mul_quantize = lib.rk_silu_mul_quantize
        self.silu_mul_quantize.argtypes = [_P, _I, _I, _I, _P, _I, _P, _P]
        self.silu_mul_quantize.restype = None
        self.gelu_tanh_mul_quantize = lib.rk_gelu_tanh_mul_quantize
        self.gelu_tanh_mul_quantize.argtypes = [_P, _I, _I, _I, _P, _I, _P, _P]
        self.gelu_tanh_mul_quantize.restype = None
        self.decode_attention = lib.rk_decode_attention
        self.decode_attention.argtypes = [
            _P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _I, _I, ctypes.c_float, ctypes.c_float, _I,
            ctypes.c_int, _P,
        ]
        self.decode_attention.restype = ctypes.c_int
        self.decode_step = lib.rk_decode_step
        self.decode_step.argtypes = [
            ctypes.POINTER(RkModel), _I, _P, _P, _P, _P, _I, _P, _P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P,
        ]
        self.decode_step.restype = ctypes.c_int


_lock = threading.Lock()
_loaded: CpuKernels | None = None


def kernels() -> CpuKernels:
    """The loaded kernels, building them first if this machine has no copy yet."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = load(_build())
        return _loaded


def load(path: Path) -> CpuKernels:
    """Load a built library (tests also load builds made with other flags)."""
    try:
        return CpuKernels(ctypes.CDLL(str(path)), path)
    except OSError as exc:
        raise NativeKernelsUnavailable(f"cannot load the C kernels from {path}: {exc}") from exc


def _compiler() -> str:
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        found = shutil.which(name)
        if found:
            return found
    raise NativeKernelsUnavailable(
        'weight_format = "int8" or "int4" needs a C compiler (set CC, or install gcc or clang); '
        'weight_format = "fp16" or "native" need none'
    )


def _cpu_signature() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{flags}"


def _build() -> Path:
    cc = _compiler()
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"|".join([source, " ".join(_FLAGS).encode(), cc.encode(), _cpu_signature().encode()]))
    target = cache_dir() / "kernels" / f"cpu_kernels-{key.hexdigest()[:20]}.so"
    if target.is_file():
        return target
    compile_library(target, cc, _FLAGS)
    return target


def compile_library(target: Path, cc: str, flags: tuple[str, ...], source: Path = SOURCE) -> None:
    """Compile the kernels (``source``: another version of them, for benchmarks) into ``target``
    (atomically: concurrent builders each write their own temporary file), with OpenMP if the
    compiler has it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".so")
    os.close(fd)
    try:
        errors = []
        # Without OpenMP (a compiler that lacks it) the kernels run on one thread.
        for extra in (("-fopenmp",), ()):
            cmd = [cc, *flags, *extra, str(source), "-o", tmp, "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode == 0:
                if not extra:
                    log.warning("C kernels built without OpenMP: they will use one thread")
                os.chmod(tmp, 0o755)  # mkstemp made it private; a shared cache serves every user
                os.replace(tmp, target)
                log.info("built the engine's C kernels: %s", target)
                return
            errors.append(f"$ {' '.join(cmd)}\n{done.stderr.strip()}")
        raise NativeKernelsUnavailable("building the C kernels failed:\n" + "\n".join(errors))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
