"""The project's original API, as its documentation writes it: op modules under bastile.ops."""
import sys

import torch
from transformers import Qwen3Config
from transformers.models.qwen3 import modeling_qwen3

import bastile


def test_op_modules_hold_the_functions_and_modules():
    from bastile.ops.rms_norm import BastileRMSNorm
    from bastile.ops.swiglu import BastileSwiGLUMLP, swiglu

    torch.manual_seed(0)
    norm, hf_norm = BastileRMSNorm(hidden_size=4096), modeling_qwen3.Qwen3RMSNorm(4096)
    with torch.no_grad():
        hf_norm.weight.normal_()
    norm.load_state_dict(hf_norm.state_dict())
    x = torch.randn(3, 4096)
    torch.testing.assert_close(norm(x), hf_norm(x))

    gate, up = torch.randn(5, 64), torch.randn(5, 64)
    torch.testing.assert_close(swiglu(gate, up), torch.nn.functional.silu(gate) * up)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128)
    mlp, hf_mlp = BastileSwiGLUMLP(cfg), modeling_qwen3.Qwen3MLP(cfg)
    mlp.load_state_dict(hf_mlp.state_dict())
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(mlp(x), hf_mlp(x))


def test_bastile_ops_names_modules_only():
    """bastile.ops.<op> is the op's module however it is reached; the function is bastile.<op>."""
    import bastile.ops.rms_norm as by_import

    assert bastile.ops.rms_norm is by_import is sys.modules["bastile.ops.rms_norm"]
    for op in ["rms_norm", "swiglu", "rope", "qk_norm_rope", "fused_linear_cross_entropy", "geglu"]:
        assert getattr(getattr(bastile.ops, op), op) is getattr(bastile, op)
