"""Packaging: every package folder is installed, and the contract imports nothing but torch."""

import configparser
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = {p.strip() for p in cfg["options"]["packages"].split() if p.strip()}
    found = set()
    for init in ROOT.glob("minite_megatron/**/__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    for init in ROOT.glob("kernels/**/__init__.py"):
        found.add(".".join(("minite_kernels",) + init.parent.relative_to(ROOT / "kernels").parts))
    assert found == listed, f"missing from setup.cfg: {sorted(found - listed)}; stale: {sorted(listed - found)}"


def test_contract_imports_only_torch():
    """Convention 1: the contract runs where Triton, CUTLASS, TE and Megatron are unavailable."""
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'triton', 'megatron', 'transformer_engine', 'cutlass', 'minite_kernels'}:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import torch
from minite_megatron import nvfp4
q = nvfp4.quantize(torch.randn(4, 32))
print(nvfp4.gemm(q, nvfp4.quantize(torch.randn(16, 32), 'tensor', (16, 16))).shape)
from minite_megatron.invariant import activations, attention, collectives, matmul, rmsnorm, softmax, topk  # noqa: F401
x = torch.randn(2, 5, 4, 8)
print(matmul.linear(x[0, 0], torch.randn(3, 8)).shape, attention.attention(x, x, x, causal=True).shape)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "torch.Size([4, 16])" in out.stdout
    assert "torch.Size([4, 3]) torch.Size([2, 5, 4, 8])" in out.stdout  # the batch-invariant math too
