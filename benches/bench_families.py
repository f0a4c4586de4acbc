"""The newer families end to end: tokens/s, peak memory and losses of HF, HF + Liger and HF + Bastile training
the same model on the same tokens, each mode in its own process.

    python benches/bench_families.py                               # every model of MODELS, three modes
    python benches/bench_families.py --models phi3-mini,glm4-9b --modes hf,bastile
    python benches/bench_families.py --models phi4-mini --profile  # and one step under torch.profiler per mode
    python benches/bench_families.py --smoke                       # tiny configs on the CPU: checks the script only
    python benches/bench_families.py --models gemma4-26b-a4b --seq 2048  # another sequence length
    python benches/bench_families.py --models qwen3_5-9b --seq 16384 --checkpoint  # HF gradient checkpointing
    python benches/bench_families.py --models llama3-8b --seq 131072 --checkpoint --modes bastile,bastile-offload
    python benches/bench_families.py --models qwen3-30b-a3b-attn --compile  # each decoder layer torch.compile'd
    python benches/bench_families.py --models qwen3-30b-a3b --seq 1024 --compile reduce-overhead  # and CUDA-graphed
    python benches/bench_families.py --models gpt-oss-20b --seq 2048 --padded 4  # padded batches of 4 rows

Models (MODELS): random init from the published configs (sizes, vocabularies, rotary and window settings,
multipliers; nothing downloaded), built on the GPU in bf16 with SDPA attention (GPT-OSS: eager, HF's only). A model that fits one H100
for a full fine-tune trains all its weights (fused AdamW, lr 1e-5); the others train PEFT LoRA r=16 (alpha
32, no dropout, adapters in PEFT's fp32) on every linear projection of the attention and dense MLP (the MoE
families' attention only; the entries of all-linear also the experts' 3-D parameters and the router), AdamW over
the adapters. Mixtral-8x7B keeps 8 of its 32 layers (the whole model
is 94 GB of bf16 weights). Labels = input ids. Modes: hf, liger (Liger Kernel's apply function for the
model type, its defaults, fused linear cross-entropy included, before the model is built), bastile
(bastile.apply()), and on request bastile-offload (bastile.apply(offload_checkpoints=True)). --steps steps (default 10), the first --warmup (3) not timed; peak GiB =
torch.cuda.max_memory_allocated over the child. --compile [MODE] compiles each decoder layer (module.compile(mode=MODE),
regional compilation) in every mode, after PEFT; the warmup steps compile (and record the CUDA graphs of
reduce-overhead). --padded ROWS: batches of ROWS rows of random lengths (seq / 4 to seq) padded on the right
(train_random's; tokens/s of real tokens); with --both-ends, an RL trainer's rows: a prompt padded on the left
and a completion on the right. Writes families.csv and .log under $OUT or
bench-results/.
"""

import torch
from bench_profile import category, kernel_times
from common import environment, failed, markdown, modes_main, modes_parser, published, run_modes, sync, train_random, train_steps

MODES = ("hf", "liger", "bastile")
# bastile.apply(offload_checkpoints=True): for long sequences under --checkpoint, on request (--modes)
OFFLOAD = "bastile-offload"
LORA = 16
LR = 1e-5

# name -> (model_type, config class, model class, config (a dict; the folder of its published config.json in
# tests/configs, or (folder, overrides); another entry's name), LoRA targets (PEFT's target_modules) or None for a full
# fine-tune, seq, batch)
MODELS = {
    # transformers' default Qwen3_5TextConfig (the 9B's text model): 32 layers, a gated attention every fourth,
    # the rest Gated DeltaNet (16 key / 32 value heads of 128); LoRA on every linear projection.
    "qwen3_5-9b": ("qwen3_5_text", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(),
                   ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                    "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"], 4096, 1),
    # Half the 9B's width and three quarters of its depth (our own config, not a published one: about 1.9B
    # parameters, small enough for a full fine-tune on one H100)
    "qwen3_5-2b-style": ("qwen3_5_text", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                         dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
                              num_key_value_heads=2, linear_num_value_heads=16, tie_word_embeddings=True),
                         None, 4096, 1),
    # Llama-3-8B: the long-context benchmark's model (--seq 131072 --checkpoint, mode bastile-offload)
    "llama3-8b": ("llama", "LlamaConfig", "LlamaForCausalLM",
                  dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=262144, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                       bos_token_id=128000, eos_token_id=128001),
                  ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4096, 1),
    "mixtral-8x7b-8l": ("mixtral", "MixtralConfig", "MixtralForCausalLM",
                        dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
                             num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-5),
                        ["q_proj", "k_proj", "v_proj", "o_proj"], 4096, 1),
    # the same 8 layers with LoRA on every linear layer and on the experts' 3-D parameters (PEFT's all-linear wraps
    # them, and the router's weight, with its ParamWrapper)
    "mixtral-8x7b-8l-experts": ("mixtral", "MixtralConfig", "MixtralForCausalLM", "mixtral-8x7b-8l", "all-linear", 4096, 1),
    # Qwen3-30B-A3B (48 layers of 128 experts, 8 a token): LoRA all-linear (the experts' parameters and the router
    # included), or on the attention alone; its first 8 layers with every weight trained
    "qwen3-30b-a3b": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen--Qwen3-30B-A3B", "all-linear",
                      4096, 1),
    "qwen3-30b-a3b-attn": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen--Qwen3-30B-A3B",
                           ["q_proj", "k_proj", "v_proj", "o_proj"], 4096, 1),
    "qwen3-30b-a3b-8l": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                         ("Qwen--Qwen3-30B-A3B", dict(num_hidden_layers=8)), None, 4096, 1),
    # the same 8 layers under LoRA, all-linear or on the attention: HF fits both, and eager against compiled
    # layers shows the host's share of a step
    "qwen3-30b-a3b-8l-lora": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3-30b-a3b-8l", "all-linear",
                              4096, 1),
    "qwen3-30b-a3b-8l-attn": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3-30b-a3b-8l",
                              ["q_proj", "k_proj", "v_proj", "o_proj"], 4096, 1),
    # the same with the router's load-balancing loss in the loss (output_router_logits, as TRL's MoE recipes set it)
    "qwen3-30b-a3b-8l-attn-aux": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                  ("Qwen--Qwen3-30B-A3B", dict(num_hidden_layers=8, output_router_logits=True,
                                                               router_aux_loss_coef=0.001)),
                                  ["q_proj", "k_proj", "v_proj", "o_proj"], 4096, 1),
    # Granite 3.1 3B-A800M (32 layers of 40 experts, 8 a token) and OLMoE-1B-7B (16 layers of 64 experts, 8 a token)
    # with every weight trained; Qwen1.5-MoE-A2.7B (24 layers of 60 experts, 4 a token, beside a gated shared expert)
    # under PEFT's all-linear LoRA (the attention, the shared expert and its gate: PEFT does not reach this family's
    # routed experts through all-linear)
    "granite-3.1-3b-a800m": ("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM",
                             "ibm-granite--granite-3.1-3b-a800m-instruct", None, 4096, 1),
    "olmoe-1b-7b": ("olmoe", "OlmoeConfig", "OlmoeForCausalLM", "allenai--OLMoE-1B-7B-0924", None, 4096, 1),
    "qwen1.5-moe-a2.7b": ("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "Qwen--Qwen1.5-MoE-A2.7B", "all-linear",
                          4096, 1),
    # ERNIE-4.5-21B-A3B (28 layers, the first dense, then 64 experts, 6 a token, beside a shared expert) under PEFT's
    # all-linear LoRA
    "ernie4.5-21b-a3b": ("ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", "baidu--ERNIE-4.5-21B-A3B-PT",
                         "all-linear", 4096, 1),
    # GLM-4.5-Air's first 8 of 46 layers (one dense, then 128 experts, 8 a token, beside a shared expert):
    # LoRA on the attention, or all-linear (the experts' 3-D parameters and the shared expert included)
    "glm4.5-air-8l": ("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM",
                      ("zai-org--GLM-4.5-Air", dict(num_hidden_layers=8)), ["q_proj", "k_proj", "v_proj", "o_proj"],
                      4096, 1),
    "glm4.5-air-8l-experts": ("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM", "glm4.5-air-8l", "all-linear",
                              4096, 1),
    # Qwen3-Next-80B-A3B's first 8 of 48 layers (6 Gated DeltaNets, 2 gated attention layers; 512 experts, 10 a
    # token, beside a gated shared expert): LoRA on the attention and the Gated DeltaNet's projections, or all-linear
    # (the experts' 3-D parameters, the shared expert and the router included)
    "qwen3-next-80b-a3b-8l": ("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
                              ("Qwen--Qwen3-Next-80B-A3B-Instruct", dict(num_hidden_layers=8)),
                              ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"], 4096,
                              1),
    "qwen3-next-80b-a3b-8l-experts": ("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", "qwen3-next-80b-a3b-8l",
                                      "all-linear", 4096, 1),
    # Qwen3-VL-8B's language model on text batches (the vision tower built, unused); LoRA on its projections only.
    "qwen3-vl-8b": ("qwen3_vl", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "Qwen--Qwen3-VL-8B-Instruct",
                    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4096, 1),
    # Mistral Small 3.1's Mistral decoder in its multimodal model (Pixtral tower unused); LoRA on the decoder's
    # projections (the tower's share their names).
    "mistral-small-3.1-24b": ("mistral3", "Mistral3Config", "Mistral3ForConditionalGeneration",
                              "mistralai--Mistral-Small-3.1-24B-Instruct-2503",
                              r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)", 4096, 1),
    # gpt-oss-20b (24 layers, sliding and full alternating, 64 heads with sinks, 32 experts, 4 a token) in bf16
    # (the published MXFP4 weights are a format for inference), LoRA on the attention
    "gpt-oss-20b": ("gpt_oss", "GptOssConfig", "GptOssForCausalLM", "openai--gpt-oss-20b",
                    ["q_proj", "k_proj", "v_proj", "o_proj"], 4096, 1),
    "phi3-mini": ("phi3", "Phi3Config", "Phi3ForCausalLM",
                  dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096, sliding_window=2047,
                       rms_norm_eps=1e-5, pad_token_id=32000, bos_token_id=1, eos_token_id=32000),
                  ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], 4096, 1),
    "phi4-mini": ("phi3", "Phi3Config", "Phi3ForCausalLM",
                  dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
                       num_key_value_heads=8, vocab_size=200064, max_position_embeddings=131072,
                       sliding_window=262144, tie_word_embeddings=True, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75},
                       pad_token_id=199999, bos_token_id=199999, eos_token_id=199999),
                  None, 4096, 1),
    "smollm3-3b": ("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM",
                   dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                        num_key_value_heads=4, vocab_size=128256, max_position_embeddings=65536,
                        no_rope_layer_interval=4, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 5e6},
                        pad_token_id=128004, bos_token_id=128000, eos_token_id=128012),
                   None, 4096, 1),
    "granite-3.3-2b": ("granite", "GraniteConfig", "GraniteForCausalLM",
                       dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=40, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=49159, max_position_embeddings=131072,
                            embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                            logits_scaling=8.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e7},
                            pad_token_id=0, bos_token_id=0, eos_token_id=0),
                       None, 4096, 2),
    "ministral3-8b": ("ministral3", "Ministral3Config", "Ministral3ForCausalLM", {},  # the config's defaults
                      ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4096, 1),
    "olmo2-1b": ("olmo2", "Olmo2Config", "Olmo2ForCausalLM",
                 dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=16, vocab_size=100352, max_position_embeddings=4096,
                      rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                      pad_token_id=100277, bos_token_id=None, eos_token_id=100257),
                 None, 4096, 2),
    "olmo3-7b": ("olmo3", "Olmo3Config", "Olmo3ForCausalLM",
                 dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=100278, max_position_embeddings=65536, sliding_window=4096,
                      layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 8,
                      pad_token_id=100277, bos_token_id=None, eos_token_id=100257),
                 ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4096, 1),
    "glm4-9b": ("glm4", "Glm4Config", "Glm4ForCausalLM",
                dict(hidden_size=4096, intermediate_size=13696, num_hidden_layers=40, num_attention_heads=32,
                     num_key_value_heads=2, head_dim=128, vocab_size=151552, attention_bias=True,
                     max_position_embeddings=32768,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                     pad_token_id=151329, eos_token_id=151329),
                ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"], 4096, 1),
    "gemma3-1b": ("gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM", "google--gemma-3-1b-it", None, 4096, 2),
    "gemma3-4b": ("gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM", "google--gemma-3-4b-it",
                  ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4096, 1),
    "gemma2-2b": ("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
                  dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
                       query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                       attn_logit_softcapping=50.0, pad_token_id=0, bos_token_id=2, eos_token_id=1),
                  ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4096, 1),
    # Gemma 4 E2B and E4B (text): per-layer embeddings (a 262144 x layers x 256 table), the last 20 (18) layers
    # reusing earlier layers' K/V, full layers of head_dim 512 with a quarter of it rotated
    "gemma4-e2b": ("gemma4_text", "Gemma4TextConfig", "Gemma4ForCausalLM", "google--gemma-4-E2B-it",
                   ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4096, 1),
    "gemma4-e4b": ("gemma4_text", "Gemma4TextConfig", "Gemma4ForCausalLM", "google--gemma-4-E4B-it",
                   ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4096, 1),
    # Gemma 4 26B-A4B (text): 128 experts (top 8) beside each dense MLP, v = k's projection on full layers
    "gemma4-26b-a4b": ("gemma4_text", "Gemma4TextConfig", "Gemma4ForCausalLM",
                       dict(hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
                            num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256, global_head_dim=512,
                            attention_k_eq_v=True, enable_moe_block=True, num_experts=128, top_k_experts=8,
                            moe_intermediate_size=704, vocab_size=262144, hidden_size_per_layer_input=0,
                            sliding_window=1024, max_position_embeddings=262144,
                            layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
                            final_logit_softcapping=30.0, tie_word_embeddings=True, pad_token_id=0, bos_token_id=2,
                            eos_token_id=1),
                       ["q_proj", "k_proj", "v_proj", "o_proj"], 4096, 1),
    # LFM2-2.6B: 30 layers, 22 of gated short convolutions and 8 of attention (32 q / 8 kv heads, q/k norms); every
    # weight trained
    "lfm2-2.6b": ("lfm2", "Lfm2Config", "Lfm2ForCausalLM", "LiquidAI--LFM2-2.6B", None, 4096, 1),
}

# HF builds GPT-OSS with eager attention only (its sinks: SDPA refused), in every mode.
ATTENTION = {"gpt_oss": "eager"}

# --smoke: each model at a tiny width, on the CPU.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, head_dim=16, moe_intermediate_size=32, num_kv_shared_layers=2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)


def sub_config(cfg_cls, name: str, config: dict):
    """The config class of config[name] (an AutoConfig slot names it by its model_type)."""
    import transformers
    cls = cfg_cls.sub_configs[name]
    return transformers.CONFIG_MAPPING[config[name]["model_type"]] if cls is transformers.AutoConfig else cls


def tiny(config: dict, cfg_cls) -> dict:
    """config at TINY's sizes: a multimodal model's text config, its vision tower at one narrow block."""
    if "text_config" in config:
        small = dict(depth=1, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_heads=2,
                     num_attention_heads=2, head_dim=16, out_hidden_size=TINY["hidden_size"], deepstack_visual_indexes=[0])
        keys = sub_config(cfg_cls, "vision_config", config)().to_dict()
        vision = {**config["vision_config"], **{k: v for k, v in small.items() if k in keys}}
        return {**config, "text_config": tiny(config["text_config"], sub_config(cfg_cls, "text_config", config)),
                "vision_config": vision}
    config = {k: v for k, v in {**config, **TINY}.items() if k in cfg_cls().to_dict() or k == "head_dim"}
    if "layer_types" in config:  # the published types alternate in their order (sliding and full layers, both before
        # any that share K/V; LFM2's short convolutions and attention)
        types, layers = list(dict.fromkeys(config["layer_types"])), TINY["num_hidden_layers"]
        config["layer_types"] = (types * layers)[:layers]
    return config


def model_config(name, smoke=False, **overrides):
    """The config of a MODELS entry (its published config.json with the entry's overrides, then `overrides`),
    without a cache; tiny for smoke runs."""
    import transformers
    _, config_cls, _, config, _, _, _ = MODELS[name]
    cfg_cls = getattr(transformers, config_cls)
    if isinstance(config, str) and config in MODELS:  # another entry's config
        config = MODELS[config][3]
    folder, own = config if isinstance(config, tuple) else (config, {})
    if isinstance(folder, str):
        multimodal = "text_config" in getattr(cfg_cls, "sub_configs", {})
        config = {k: v for k, v in published(folder, whole=multimodal).items()
                  if k not in ("model_type", "transformers_version", "quantization_config")}
    config = {**config, **own, **overrides}
    if smoke:
        config = tiny(config, cfg_cls)
    return cfg_cls(**{**config, "use_cache": False})


def model_class(name):
    import transformers
    return getattr(transformers, MODELS[name][2])


def build(mode, name, device, smoke, checkpoint, compiled=None):
    model_type, _, _, _, targets, _, _ = MODELS[name]
    if mode == "liger":
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
        if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
            raise LookupError(f"no Liger Kernel for {model_type}")
        MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]()
    if mode in ("bastile", OFFLOAD):
        import bastile
        bastile.apply(offload_checkpoints=mode == OFFLOAD)
    cfg = model_config(name, smoke)
    torch.manual_seed(0)
    with torch.device(device):
        net = model_class(name)._from_config(cfg, dtype=torch.bfloat16,
                                             attn_implementation=ATTENTION.get(model_type, "sdpa"))
    if checkpoint:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if targets:
        from peft import LoraConfig, get_peft_model
        net = get_peft_model(net, LoraConfig(r=LORA, lora_alpha=2 * LORA, lora_dropout=0.0, target_modules=targets))
    if compiled:
        from transformers.modeling_layers import GradientCheckpointingLayer
        for layer in net.modules():
            if isinstance(layer, GradientCheckpointingLayer):
                layer.compile(mode=compiled)
    net.train()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=LR, fused=device == "cuda")
    return net, opt, cfg.get_text_config().vocab_size


def child(args) -> dict:
    _, _, _, _, targets, seq, batch = MODELS[args.model]
    seq, batch = (64, 2) if args.smoke else (args.seq or seq, batch)
    batch = args.padded or batch
    work = ((f"LoRA r{LORA}" if targets else "full") + (", checkpointed" if args.checkpoint else "")
            + ((", padded at both ends" if args.both_ends else ", padded") if args.padded else "")
            + (f", layers compiled ({args.compile})" if args.compile else ""))
    result = {"model": args.model, "mode": args.mode, "work": work,
              "seq": seq, "batch": batch}
    try:
        result["env"] = environment()
        net, opt, vocab = build(args.mode, args.model, args.device, args.smoke, args.checkpoint, args.compile)
        pad = ("both" if args.both_ends else "right") if args.padded else ""
        train_random(result, net, opt, vocab, batch, seq, args, pad=pad)
        if args.profile:
            result["profile"] = profile_step(net, opt, torch.randint(0, vocab, (batch, seq), device=args.device),
                                             args.device)
    except Exception as e:  # noqa: BLE001
        result["status"] = failed(e)
    return result


def profile_step(net, opt, ids, device) -> dict:
    """One more step under torch.profiler: GPU milliseconds per category (bench_profile.py's) and the top
    kernels."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train_steps(net, opt, [ids], 0, device, sync)
    times = kernel_times(prof, device == "cuda")
    cats = {}
    for name, (us, _) in times.items():
        cats[category(name)] = cats.get(category(name), 0.0) + us / 1e3
    top = sorted(times.items(), key=lambda kv: -kv[1][0])[:12]
    return {"categories_ms": {c: round(ms, 2) for c, ms in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top_ms": [(name[:90], round(us / 1e3, 2), calls) for name, (us, calls) in top]}


def row(result, name, mode):
    losses = result.get("losses") or []
    return {"model": name, "mode": mode, "work": result.get("work", ""),
            "seq x batch": f"{result.get('seq', '')} x {result.get('batch', '')}", "status": result["status"],
            "tokens/s": f"{result['tokens_per_s']:.0f}" if "tokens_per_s" in result else "",
            "peak GiB": f"{result['peak_alloc_GiB']:.2f}" if "peak_alloc_GiB" in result else "",
            "loss first": f"{losses[0]:.4f}" if losses else "", "loss last": f"{losses[-1]:.4f}" if losses else "",
            "losses": " ".join(f"{l:.5f}" for l in losses)}


def versus(rows):
    """Bastile's tokens/s over HF's and Liger's, and its last loss against HF's, per model."""
    out = []
    for name in dict.fromkeys(r["model"] for r in rows):
        by = {r["mode"]: r for r in rows if r["model"] == name and r["status"] == "ok"}
        if "bastile" not in by:
            continue
        b = by["bastile"]
        ratio = lambda m: f"{float(b['tokens/s']) / float(by[m]['tokens/s']):.2f}x" if m in by else "-"
        loss = (f"{(float(b['loss last']) - float(by['hf']['loss last'])) / float(by['hf']['loss last']):+.3%}"
                if "hf" in by else "-")
        out.append({"model": name, "vs HF": ratio("hf"), "vs Liger": ratio("liger"), "last loss vs HF": loss})
    return out


def parent(args):
    names = args.models.split(",") if args.models else list(MODELS)
    extra = ((["--smoke"] if args.smoke else []) + (["--profile"] if args.profile else [])
             + ([f"--seq={args.seq}"] if args.seq else []) + (["--checkpoint"] if args.checkpoint else [])
             + ([f"--compile={args.compile}"] if args.compile else [])
             + ([f"--padded={args.padded}"] if args.padded else []) + (["--both-ends"] if args.both_ends else []))

    def show(result):
        if "profile" in result:
            print(f"  GPU ms by category: {result['profile']['categories_ms']}", flush=True)
            for kernel, ms, calls in result["profile"]["top_ms"]:
                print(f"    {ms:9.2f} ms {calls:5d}x {kernel}", flush=True)
    rows, env = run_modes(__file__, args, names, args.modes.split(","), row, "families", extra, show=show)
    print(env, flush=True)
    print(markdown(rows, [c for c in rows[0] if c != "losses"]))
    print(markdown(versus(rows), ["model", "vs HF", "vs Liger", "last loss vs HF"]), flush=True)


def main():
    ap = modes_parser(__doc__, (*MODES, OFFLOAD), timeout=240)
    ap.set_defaults(modes=",".join(MODES))
    ap.add_argument("--models", help="comma-separated names of MODELS (default: all)")
    ap.add_argument("--profile", action="store_true", help="also profile one step: GPU time by category, top kernels")
    ap.add_argument("--seq", type=int, help="every model's sequence length (default: each model's own)")
    ap.add_argument("--checkpoint", action="store_true", help="HF gradient checkpointing (non-reentrant)")
    ap.add_argument("--compile", nargs="?", const="default", metavar="MODE",
                    help="each decoder layer torch.compile'd (regional), in torch.compile's MODE (default: default)")
    ap.add_argument("--padded", type=int, default=0, metavar="ROWS",
                    help="batches of ROWS right-padded rows of random lengths (seq / 4 to seq)")
    ap.add_argument("--both-ends", action="store_true",
                    help="with --padded: each row a prompt padded on the left and a completion on the right")
    modes_main(ap.parse_args(), child, parent)


if __name__ == "__main__":
    main()
