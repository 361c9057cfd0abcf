"""Contract (CPU): the Triton kernels of PSA's sketch path lower to Triton IR for an sm_90 target with the launch
constants their wrappers use. Type errors the CPU interpreter never sees — a subnormal constant typing a loop-carried
value fp64, a branch changing a variable's type — fail here rather than on the GPU. The lowering runs in a child
process without ``TRITON_INTERPRET`` (the interpreter patches ``triton.language`` in this one)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

LOWER = textwrap.dedent('''
    import importlib, json, sys
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton._C.libtriton import ir
    module, name, types, const = json.loads(sys.argv[1])
    fn = getattr(importlib.import_module(module), name)
    names = fn.arg_names
    sig = {n: ("constexpr" if n in const else types.get(n, "i32")) for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    opts = backend.parse_options({})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    mod = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), ctx)
    print("lowered", name, len(str(mod)))
''')


def _lower(module: str, name: str, types: dict, const: dict) -> None:
    import json

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", LOWER, json.dumps([module, name, types, const])], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"lowered {name}" in p.stdout


@pytest.mark.parametrize("tile,group", [(2048, 3), (256, 1), (2048, 4)])
def test_select_kernel_lowers_for_sm90(tile, group):
    ptrs = {n: "*fp32" for n in ("mass_ptr", "eps_ptr", "probe_eps_ptr", "scores_ptr", "kept_ptr", "tot_ptr")}
    ptrs.update({n: "*i32" for n in ("seq_lens_ptr", "caps_ptr", "probe_caps_ptr", "list_lens_ptr", "probe_ptr")})
    ptrs.update(lists_ptr="*i64", slack_factor="fp32")
    _lower("flashinfer_ext.psa.sketch_select", "_select_kernel", ptrs,
           dict(NUM_KV_HEADS=3, GROUP=group, G_PAD=max(1, 1 << (group - 1).bit_length()), BLOCK_SIZE=16, TILE=tile,
                STEPS=11, FLOOR=40.0))


@pytest.mark.parametrize("dtype,head_dim,group", [("bf16", 64, 3), ("fp16", 128, 4)])
def test_block_mass_kernel_lowers_for_sm90(dtype, head_dim, group):
    from flashinfer_ext.psa.key_sketch import _block_mass_shape

    ptrs = {"q_ptr": f"*{dtype}", "codes_ptr": "*i32", "scales_ptr": "*fp16", "block_table_ptr": "*i32",
            "seq_lens_ptr": "*i32", "mass_ptr": "*fp32", "scale_log2": "fp32"}
    _lower("flashinfer_ext.psa.key_sketch", "_block_mass_kernel", ptrs,
           dict(NUM_KV_HEADS=3, GROUP=group, IS_BF16=dtype == "bf16", DOT_FP32=False,
                **_block_mass_shape(group, head_dim, 16, 0)))


def test_shares_kernel_lowers_for_sm90():
    ptrs = {"mass_ptr": "*fp32", "seq_lens_ptr": "*i32", "scores_ptr": "*fp32", "keys_ptr": "*i16", "tot_ptr": "*fp32"}
    _lower("flashinfer_ext.psa.key_sketch", "_shares_kernel", ptrs,
           dict(NUM_KV_HEADS=3, GROUP=3, G_PAD=4, BLOCK_SIZE=16, TILE=512, WRITE_KEYS=True))
