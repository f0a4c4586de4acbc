"""The project's original API, as its documentation writes it: op modules under bastile.ops, apply's `moe`,
reset() then reset([...]), families by name, and the library-wide controls on a machine without a GPU."""
import os
import subprocess
import sys

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.qwen3 import modeling_qwen3

import bastile

HF_NORM = modeling_qwen3.Qwen3RMSNorm.forward  # read before any test patches it


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


def test_kernel_keywords_are_aliases_of_roles():
    """The keywords of earlier releases keep working: moe and geglu (GPT-OSS's experts' activation) and swiglu
    name the MLP role, rms_norm the norms, rope the attention, fused_linear_cross_entropy the head."""
    names = bastile.apply(rms_norm=True, moe=True, rope=True)
    assert {"mlp_gpt_oss", "norm_qwen3", "attention_llama"} <= set(names)
    assert modeling_gpt_oss.GptOssExperts._apply_gate is bastile.hf.geglu_apply_gate
    bastile.reset()
    assert "mlp_gpt_oss" not in bastile.apply(moe=False)
    bastile.reset()
    assert not any(n.startswith(("norm_", "head_")) for n in bastile.apply(rms_norm=False, fused_linear_cross_entropy=False))
    assert "mlp_gpt_oss" in bastile.apply(geglu=True, moe=True)
    with pytest.raises(ValueError, match=r"\{'geglu': True, 'moe': False\} disagree"):
        bastile.apply(geglu=True, moe=False)


def test_reset_all_then_by_name():
    bastile.apply()
    assert "norm_qwen3" in bastile.reset()
    assert bastile.reset(["norm_qwen3"]) == []  # not active: harmless, as applying twice is
    assert modeling_qwen3.Qwen3RMSNorm.forward is HF_NORM


def test_reset_a_name_given_twice_restores_it_once():
    bastile.apply(families=["qwen3"])
    assert bastile.reset(["norm_qwen3", "rms_norm_qwen3"]) == ["norm_qwen3"]  # the second is its alias
    assert modeling_qwen3.Qwen3RMSNorm.forward is HF_NORM


def test_reset_an_unknown_name_restores_nothing():
    bastile.apply(families=["qwen3"])
    with pytest.raises(ValueError, match=r"bastile.reset: unknown patches \['norm_qwen4'\]; the patches are: "):
        bastile.reset(["norm_qwen3", "norm_qwen4"])
    assert "norm_qwen3" in bastile.get_patched_ops()
    assert modeling_qwen3.Qwen3RMSNorm.forward is bastile.hf.rms_norm_forward


def test_apply_takes_one_family_by_name():
    names = bastile.apply(families="qwen3", log_probs=False)
    assert names == ["norm_qwen3", "mlp_qwen3", "attention_qwen3", "decoder_qwen3", "head_qwen3"]
    assert bastile.get_patched_ops() == sorted(names)


def test_controls_without_a_gpu_do_nothing():
    """The same script runs where there is no GPU: nothing to warm up, no cache to clear."""
    script = ("import torch, bastile\nassert not torch.cuda.is_available()\n"
              "assert bastile.warmup_all_kernels() is None and bastile.clear_autotune_cache() is None\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr
