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
from transformers.models.qwen3_moe import modeling_qwen3_moe

import bastile
from conftest import NO_TRAINERS, needs_cuda

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


def test_kernel_keywords_switch_the_part_they_name():
    """The keywords of earlier releases keep working, each switching the part of a role its kernel served: moe and
    geglu (GPT-OSS's experts' activation) the MoE experts, swiglu the dense MLP, rms_norm the norms, rope the
    attention, fused_linear_cross_entropy the head; a part's keyword decides it over its role's."""
    moe_mlp, experts = modeling_qwen3_moe.Qwen3MoeMLP.__dict__["forward"], modeling_qwen3_moe.Qwen3MoeExperts.forward
    names = bastile.apply(rms_norm=True, moe=True, rope=True, swiglu=False)
    assert {"mlp_gpt_oss", "norm_qwen3", "attention_llama", "mlp_qwen3_moe"} <= set(names)
    assert "mlp_qwen3" not in names  # its one part, the dense MLP, is off
    assert modeling_gpt_oss.GptOssExperts.forward.__name__ == "mlp.experts[gpt_oss]"
    assert modeling_qwen3_moe.Qwen3MoeMLP.__dict__["forward"] is moe_mlp
    assert modeling_qwen3_moe.Qwen3MoeExperts.forward.__name__ == "mlp.experts[qwen3_moe]"
    assert "mlp_qwen3" in bastile.apply(swiglu=True)  # the part left out is added; the rest stays
    assert modeling_qwen3_moe.Qwen3MoeMLP.__dict__["forward"] is not moe_mlp
    assert bastile.reset(["mlp_qwen3_moe"]) == ["mlp_qwen3_moe"]
    assert modeling_qwen3_moe.Qwen3MoeMLP.__dict__["forward"] is moe_mlp
    assert modeling_qwen3_moe.Qwen3MoeExperts.forward is experts
    bastile.reset()
    assert "mlp_gpt_oss" not in bastile.apply(moe=False)
    bastile.reset()
    names = bastile.apply(mlp=False, moe=True)
    assert "mlp_gpt_oss" in names and "mlp_qwen3" not in names
    bastile.reset()
    assert not any(n.startswith(("norm_", "head_")) for n in bastile.apply(rms_norm=False, fused_linear_cross_entropy=False))
    bastile.reset()
    assert "mlp_gpt_oss" in bastile.apply(geglu=True, moe=True)
    with pytest.raises(ValueError, match=r"\{'moe': False, 'geglu': True\} disagree, but they name one part of the "
                                         r"'mlp' role, its experts"):
        bastile.apply(geglu=True, moe=False)
    with pytest.raises(ValueError, match=r"\{'norm': True, 'rms_norm': False\} disagree, but they name one role"):
        bastile.apply(norm=True, rms_norm=False)


# The seed's documented calls (github.com/aghilann/bastile: README.md at ca10a92, f309ce6 and f383541,
# GPT_OSS_BENCHMARKS.md at 1dd3dcc), verbatim. They load checkpoints by name: a hub cache made for the test
# holds small random ones under those names (HF_HUB_OFFLINE). `torch`, `input_ids` and `labels`, which the
# training snippet uses without defining, are set before it.
SEED = {
    "quick start": """
import bastile

# Apply all patches BEFORE loading / creating the model
bastile.apply()

from transformers import Qwen3ForCausalLM

model = Qwen3ForCausalLM.from_pretrained("Qwen/Qwen3-8B")
model.train()

# Train as usual — Bastile automatically uses optimized kernels
""",
    "selective": """
bastile.apply(
    rms_norm=True,                   # CuTile RMSNorm
    swiglu=True,                     # CuTile SwiGLU MLP
    rope=True,                       # CuTile RoPE
    fused_linear_cross_entropy=True,  # CuTile fused linear + CE
)
""",
    "reset": """
bastile.reset()
""",
    "api": """
import bastile

bastile.apply()                  # Patch all ops
bastile.apply(rope=False)        # Patch everything except RoPE
bastile.reset()                  # Restore original implementations
bastile.get_patched_ops()        # List currently active patches
bastile.warmup_all_kernels()     # Pre-compile kernels (avoids JIT lag)
bastile.clear_autotune_cache()   # Clear kernel caches
""",
    "first quick start": """
import bastile

# Apply all optimized kernels before loading your model
bastile.apply()

# Load and finetune your model as usual
from transformers import Qwen3ForCausalLM
model = Qwen3ForCausalLM.from_pretrained("Qwen/Qwen3-0.6B")

# Training works with full gradient support
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
loss = model(input_ids, labels=labels).loss
loss.backward()  # Gradients flow through optimized kernels
optimizer.step()
""",
    "first selective": """
import bastile

# Apply only specific optimizations
bastile.apply(
    rms_norm=True,   # CuTile RMSNorm (forward + backward)
    swiglu=True,     # CuTile SwiGLU MLP (forward + backward)
    rope=True,       # RoPE with autograd support
)

# Check what's patched
print(bastile.get_patched_ops())

# Reset all patches
bastile.reset()
""",
    "first apply": """
applied = bastile.apply(rms_norm=True, swiglu=True, rope=True)
# Returns: ['rms_norm_qwen3', 'swiglu_qwen3', 'rope_qwen3']
""",
    "first reset": """
bastile.reset()  # Reset all
bastile.reset(['rms_norm_qwen3'])  # Reset specific patches
""",
    "gpt-oss quick start": """
import bastile

# Apply patches BEFORE loading model
bastile.apply()

from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("openai/gpt-oss-20b")

# Train as usual - Bastile automatically uses optimized GEGLU MoE kernel
""",
    "gpt-oss api": """
import bastile

# Apply effective patches (moe by default for GPT-OSS)
# This automatically warms up kernels to avoid JIT overhead during training
bastile.apply()

# Selective patching
bastile.apply(
    rms_norm=False,  # Disabled - PyTorch is faster
    swiglu=False,    # Disabled - PyTorch is faster
    rope=False,      # Disabled - similar performance
    moe=True,        # Enabled - +16% for GPT-OSS
)

# Manual warmup (if needed before training loop)
bastile.warmup_all_kernels()

# Reset all patches
bastile.reset()

# Clear autotuning cache (for re-tuning)
bastile.clear_autotune_cache()

# Get applied patches
bastile.get_patched_ops()
""",
    "gpt-oss geglu only": """
applied = bastile.apply(rms_norm=False, moe=True)  # Only GEGLU
""",
    "gpt-oss rmsnorm rope geglu": """
applied = bastile.apply(rms_norm=True, moe=True, rope=True, swiglu=False)
# Now uses: RMSNorm + RoPE + GEGLU
""",
}

# What each snippet leaves (run after it, in its namespace).
AFTER = {
    "quick start": "assert model(**batch).logits is None; check(model, 'qwen3')",
    "selective": "assert {'norm_qwen3', 'mlp_qwen3', 'attention_qwen3', 'head_qwen3'} <= set(bastile.get_patched_ops())",
    "reset": "assert bastile.get_patched_ops() == []",
    "api": "assert bastile.get_patched_ops() == []",
    "first quick start": "assert model.lm_head.weight.grad is not None; check(model, 'qwen3')",
    "first selective": "assert bastile.get_patched_ops() == []",
    "first apply": "assert {'norm_qwen3', 'mlp_qwen3', 'attention_qwen3'} <= set(applied)",
    "first reset": "assert bastile.get_patched_ops() == []",
    "gpt-oss quick start": "model.train(); assert model(**batch).logits is None; check(model, 'gpt_oss')",
    "gpt-oss api": "assert bastile.get_patched_ops() == []",
    "gpt-oss geglu only": "assert 'mlp_gpt_oss' in applied and not [n for n in applied if n.startswith('norm_')]",
    "gpt-oss rmsnorm rope geglu": "assert {'norm_gpt_oss', 'attention_gpt_oss', 'mlp_gpt_oss'} <= set(applied) "
                                  "and 'mlp_qwen3' not in applied",
}

HARNESS = """
import json, sys, torch
import bastile
from bastile.families import FAMILIES
input_ids = torch.randint(3, 512, (2, 24))
labels = input_ids
batch = dict(input_ids=input_ids, labels=labels)

def check(model, family):  # the model's family patched in every role, and its forward ran Bastile's
    assert FAMILIES[family].module == type(model).__module__
    assert {f"{role}_{family}" for role in bastile.patch.ROLES} <= set(bastile.get_patched_ops())

for name, code in json.loads(sys.argv[1]).items():
    bastile.reset()
    namespace = dict(globals())
    print("running", name, flush=True)
    exec(code, namespace)
    exec(json.loads(sys.argv[2])[name], namespace)
    print("ran", name, flush=True)
"""


def hub_cache(root):
    """An HF hub cache holding small random checkpoints under the names the seed's snippets load."""
    from test_families import mini

    models = {"Qwen/Qwen3-8B": mini("qwen3", "cpu", torch.float32), "Qwen/Qwen3-0.6B": mini("qwen3", "cpu", torch.float32),
              "openai/gpt-oss-20b": mini("gpt_oss", "cpu", torch.float32)}
    for repo, model in models.items():
        folder = root / "hub" / f"models--{repo.replace('/', '--')}"
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text("0" * 40)
        model.save_pretrained(folder / "snapshots" / ("0" * 40))


def test_seed_snippets_run_as_written(tmp_path):
    import json

    hub_cache(tmp_path)
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-c", HARNESS, json.dumps(SEED), json.dumps(AFTER)], capture_output=True,
                         text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.count("ran ") == len(SEED), run.stdout


SEED_OPS = """
from bastile.ops.rms_norm import BastileRMSNorm
from bastile.ops.swiglu import swiglu, BastileSwiGLUMLP

# RMSNorm with gradient support
norm = BastileRMSNorm(hidden_size=4096).cuda()
x = torch.randn(2, 128, 4096, device="cuda", requires_grad=True)
y = norm(x)
y.sum().backward()  # Gradients work!

# SwiGLU with gradient support
a = torch.randn(2, 128, 2048, device="cuda", requires_grad=True)
b = torch.randn(2, 128, 2048, device="cuda", requires_grad=True)
c = swiglu(a, b)  # silu(a) * b
c.sum().backward()  # da and db computed
"""


@needs_cuda
def test_seed_ops_snippet_runs_as_written():
    namespace = {"torch": torch}
    exec(SEED_OPS, namespace)
    x = namespace["x"].detach().clone().requires_grad_()  # HF's norm of the same (unit) weight
    modeling_qwen3.Qwen3RMSNorm(4096).cuda()(x).sum().backward()
    torch.testing.assert_close(namespace["x"].grad, x.grad)
    a, b = namespace["a"], namespace["b"]
    torch.testing.assert_close(b.grad, torch.nn.functional.silu(a.detach()))


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
    assert modeling_qwen3.Qwen3RMSNorm.forward.__name__ == "norm.forward[qwen3]"


def test_apply_takes_one_family_by_name():
    names = bastile.apply(families="qwen3", **NO_TRAINERS)
    assert names == ["norm_qwen3", "mlp_qwen3", "attention_qwen3", "decoder_qwen3", "head_qwen3"]
    assert bastile.get_patched_ops() == sorted(names)


def test_controls_without_a_gpu_do_nothing():
    """The same script runs where there is no GPU: nothing to warm up, no cache to clear."""
    script = ("import torch, bastile\nassert not torch.cuda.is_available()\n"
              "assert bastile.warmup_all_kernels() is None and bastile.clear_autotune_cache() is None\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr
