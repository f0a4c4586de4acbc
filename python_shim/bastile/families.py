"""What each supported model family is, declared once as data, and the check that a model is what its
family declares.

A family (an HF `model_type`) is its traits: how its RMSNorm rounds, what its attention does around the
projections (fused q/k/v, q/k norms per head or over the whole width, the rotary layout, NoPE layers, the
sliding-window source, a position-dependent query scale, sinks, an output gate), linear-attention layers in
place of attention (Qwen3.5's and Qwen3-Next's Gated DeltaNet) or gated short convolutions (LFM2's), its
MLP (separate or fused gate/up, MoE experts and their activation), the norms and multipliers around each
sublayer, and its head (a logit scale, the router's auxiliary loss). The forwards (roles/) are built from stages these traits
choose; nothing there probes a module to guess what it is.
`check(model, parts)` refuses, naming the module or config key, a model that carries anything the traits do
not declare (a subclass of a class the forwards replace or call into, a config key that the family's modeling
code reads and the traits do not cover, a trait value out of range, weights quantized by a method Bastile does
not know), before anything runs. Keys that no modeling code reads are accepted: they cannot change the math
(`reads`).
"""
import functools
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Dict, FrozenSet, Iterable, Mapping, Optional, Tuple


class Norm(Enum):
    """Where an RMSNorm rounds to the input's dtype: before the weight multiplies (Llama:
    weight * to(x.dtype)(n)) or after (OLMo 2, GPT-OSS: to(x.dtype)(weight * n)); Gemma's multiplies by
    (1 + weight) in float32, then rounds, and keeps its epsilon in `eps`; Gemma 4's multiplies by its weight
    in float32, then rounds, keeps its epsilon in `eps`, and has no weight where `with_scale` is False."""
    CAST_THEN_WEIGHT = "cast, then weight"
    WEIGHT_THEN_CAST = "weight, then cast"
    OFFSET_THEN_CAST = "1 + weight, then cast"
    OPTIONAL_WEIGHT_THEN_CAST = "weight if any, then cast"


class QkNorm(Enum):
    """RMSNorm of q and k before the rotation: none, per head over head_dim (Qwen3), or over the whole
    projection width before the heads are split (OLMo 2)."""
    NONE = "none"
    PER_HEAD = "per head"
    FULL_WIDTH = "full width"


class Window(Enum):
    """Where the attention's sliding window comes from: none, the config's `sliding_window` (Mistral), the
    attention module's `sliding_window`, set per layer from config.layer_types (Qwen2), or the config's
    `sliding_window` on the layers config.layer_types calls sliding, whose attention HF windows by its mask only
    (Qwen2-MoE)."""
    NONE = "none"
    CONFIG = "config"
    LAYER = "layer"
    LAYER_TYPE = "layer type"


class Layout(Enum):
    """Which elements a rotation pairs: (i, i + rot/2) with tables as wide as the rotated part (Llama), the
    same with tables half as wide (GPT-OSS), or (2j, 2j + 1) with the first half of the tables (GLM-4)."""
    HALF_SPLIT = "half split"
    HALF_TABLES = "half split, half-width tables"
    INTERLEAVED = "interleaved"


@dataclass(frozen=True)
class Rotary:
    layout: Layout = Layout.HALF_SPLIT
    # The tables may be narrower than the head: only their width is rotated (Phi-3's and GLM-4's
    # partial_rotary_factor); elsewhere a partial factor is refused.
    partial: bool = False
    # The attention module's boolean attribute saying whether its layer rotates (SmolLM3's NoPE layers).
    layer_flag: Optional[str] = None
    # The tables are f32 and the rotated q, k are cast back to their input dtype (OLMo 2 and 3).
    cast_back: bool = False
    # Multimodal RoPE (Qwen3.5): the tables are built from one position per section (time, height, width),
    # which HF's rotary module interleaves into them, and position ids may come as [3, batch, seq] (the
    # sections') or [4, batch, seq] (the text positions first, then the sections'); the packed-sequence check
    # reads the text positions, where HF's decoder has them.
    sections: bool = False


@dataclass(frozen=True)
class Attention:
    fused_qkv: bool = False             # one qkv_proj (Phi-3) instead of q_proj, k_proj, v_proj
    qk_norm: QkNorm = QkNorm.NONE
    qk_norm_flag: Optional[str] = None  # the module's boolean attribute saying whether it has them (GLM-4.5's)
    window: Window = Window.NONE
    query_scale: bool = False           # Ministral 3: q *= 1 + beta * log(1 + floor(position / original max))
    sinks: bool = False                 # GPT-OSS: a learned sink logit per head (sinks.py)
    softcap: bool = False               # Gemma 2: the module's attn_logit_softcapping goes to HF's attention
    # Gemma 4's K/V: v through the module's v_norm; a module without v_proj takes k's projection as v
    # (attention_k_eq_v); a module whose is_kv_shared_layer is set takes k and v from shared_kv_states, where
    # the last earlier layer of its type (store_full_length_kv) put them (num_kv_shared_layers).
    shared_kv: bool = False
    # Qwen3.5: q_proj gives each head's query followed by as wide a gate, and the attention's output is
    # multiplied by sigmoid(gate) before o_proj.
    output_gate: bool = False
    # The module's attributes: its output projection, its q and k norms, and its dropout probability (None: it
    # has none, and HF's forward passes 0). LFM2's are out_proj, q_layernorm and k_layernorm, with no dropout.
    output: str = "o_proj"
    norms: Tuple[str, str] = ("q_norm", "k_norm")
    dropout: Optional[str] = "attention_dropout"


@dataclass(frozen=True)
class Router:
    """A MoE block's top-k router, `<prefix>TopKRouter` (weight [experts, hidden], top_k): its logits, and each
    token's top_k experts and their weights. `kind` "softmax": weighted by the softmax of all logits at them or,
    renormalised, by the softmax over the chosen (what HF's top-k of the softmax divided by its sum and GPT-OSS's
    softmax of the top-k logits both give); a sigmoid router's family ("glm4_moe", "lfm2_moe"): its own stage
    (roles/mlp.py), the scores sigmoid(logits) chosen with a correction bias, scaled by routed_scaling_factor;
    "gemma4": Gemma4TextRouter's, renormalised softmax weights times a learned scale per expert; "ernie4_5_moe":
    the softmax plus a correction bias choosing, the renormalising sum clamped at moe_norm_min; "granitemoe": float32
    logits, the softmax over the top-k in the hidden states' dtype."""
    kind: str = "softmax"
    renorm: Optional[str] = None        # the router's attribute saying whether it renormalises; None: it always does
    weights: str = "logits"             # the weights' dtype: the logits' ("logits"), or "float32" (Mixtral's)
    bias: bool = False                  # the logits add the router's bias (GPT-OSS)
    # The MoE block (<prefix>MoE) runs Bastile's forward too, unpacking the router's outputs in Bastile's order
    # (logits, weights, experts): GraniteMoE's, whose router returns them in another order in transformers 5.17
    block: bool = False


@dataclass(frozen=True)
class Mlp:
    dense: bool = True                  # `<prefix>MLP` is a SwiGLU MLP (in MoE families: the dense layers')
    fused_gate_up: bool = False         # one gate_up_proj, gate first (Phi-3, GLM-4)
    # The dense MLP's activation module; None where its forward calls F.silu itself (LFM2)
    activation: Optional[str] = "act_fn"
    # The dense MLP's gate, up (where not fused) and down projections (LFM2's w1, w3, w2)
    projections: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    experts: Optional[str] = None       # the experts' activation: "swiglu" or "geglu" (GPT-OSS's clamped one)
    # The swiglu experts' activation module; None where they hold F.silu, a function, as act_fn (LFM2-MoE)
    expert_activation: Optional[str] = "act_fn"
    router: Optional[Router] = None     # the MoE block's router, where it is one Bastile's forward runs
    router_scores: bool = False         # the MoE block returns (hidden, router scores) (GPT-OSS)
    # Gemma 4 (enable_moe_block): the layer's router and experts run beside its dense MLP, on the MLP's
    # residual input: post_feedforward_layernorm_1(mlp) + post_feedforward_layernorm_2(experts(
    # pre_feedforward_layernorm_2(h), router(h)))
    beside: bool = False


@dataclass(frozen=True)
class Residual:
    """The decoder layer: the norms (attributes of the layer, None where there is none) before and after
    each sublayer, then `residual + dropout(out) * multiplier`."""
    mlp: str = "mlp"                    # the layer's attribute holding its MLP (LFM2's feed_forward)
    attention_in: Optional[str] = "input_layernorm"
    attention_out: Optional[str] = None
    mlp_in: Optional[str] = "post_attention_layernorm"
    mlp_out: Optional[str] = None
    multiplier: Optional[str] = None    # the layer's attribute (Granite's residual_multiplier)
    dropout: Optional[Tuple[str, str]] = None  # the layer's dropout modules after attention and MLP (Phi-3)
    # Gemma 4's per-layer embeddings: after the MLP, h + post_per_layer_input_norm(per_layer_projection(
    # act_fn(per_layer_input_gate(h)) * per_layer_input)), per_layer_input the layer's second argument; then the
    # output times the layer's layer_scalar.
    per_layer_input: bool = False


PRE_NORM = Residual()
SANDWICH = Residual(attention_out="post_self_attn_layernorm", mlp_out="post_mlp_layernorm")
GEMMA = Residual(attention_out="post_attention_layernorm", mlp_in="pre_feedforward_layernorm",
                 mlp_out="post_feedforward_layernorm")
GEMMA4 = Residual(attention_out="post_attention_layernorm", mlp_in="pre_feedforward_layernorm",
                  mlp_out="post_feedforward_layernorm", per_layer_input=True)
POST_NORM = Residual(attention_in=None, attention_out="post_attention_layernorm", mlp_in=None,
                     mlp_out="post_feedforward_layernorm")


@dataclass(frozen=True)
class Head:
    logit_divisor: Optional[str] = None  # config key: logits = lm_head(h) / config.<key> (Granite)
    softcap: Optional[str] = None        # config key: logits = c * tanh(logits / c), c = config.<key> (Gemma 2, 3)
    router_aux_loss: bool = False        # MoE: the router's load-balancing loss is added to the loss
    # MoE without that loss (GLM-4.5, LFM2-MoE): from transformers 5.23 the head returns MoeCausalLMOutputWithPast
    # with the router logits the decoder records when the call asks (output_router_logits); before, a
    # CausalLMOutputWithPast
    router_logits: bool = False
    # <prefix><output>: the causal LM's output class, where it has fields beyond CausalLMOutputWithPast's, which
    # are taken from the decoder's output (Gemma 4's shared_kv_states)
    output: Optional[str] = None


@dataclass(frozen=True)
class Off:
    """A config flag the family's forwards assume off (false or None, or one of `allowed`), and why; under transformers
    releases older than `before` only, where given (a later release's modeling code makes the flag work)."""
    why: str
    allowed: Tuple = ()
    before: Optional[str] = None


@dataclass(frozen=True)
class Multimodal:
    """A multimodal model whose language model is the family's decoder (its text_config the family's
    config): <prefix><head> holds that decoder, and an lm_head Bastile's head replaces; its vision tower
    stays HF's."""
    model_type: str
    config: FrozenSet[str]              # its config keys, beyond PretrainedConfig's
    inputs: Tuple[str, ...]             # what its forward takes beyond a causal LM's, for its inner model
    head: str = "ForConditionalGeneration"
    # The head's output class: the first of these names (`{prefix}`: the wrapper's) its modeling module has.
    # Transformers 5.17 has Qwen3.5's own subclasses (their rope_deltas), 5.23 returns HF's classes.
    output: Tuple[str, ...] = ("{prefix}CausalLMOutputWithPast",)
    softcap: bool = False               # its head softcaps the logits as the family's (Head.softcap, text config)
    labels: bool = True                 # its inner model takes the labels (Gemma 3's masks read them)
    # Its modeling module's name and its classes' prefix, where they are not the family's (Mistral 3's wrapper
    # of Ministral 3, in modeling_mistral3)
    module: Optional[str] = None
    prefix: Optional[str] = None


def modeling(module: str) -> str:
    """transformers' modeling module of a model folder's name."""
    return f"transformers.models.{module}.modeling_{module}"


# Config keys every supported family's traits cover (beyond PretrainedConfig's own): head_dim through getattr
# where its config class has no such field.
_SHARED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_parameters",
    "attention_dropout",
})
_MOE = frozenset({"num_experts_per_tok", "num_local_experts", "output_router_logits", "router_aux_loss_coef"})
_PER_LAYER = frozenset({"layer_types", "sliding_window"})  # a window on the layers config.layer_types says
# Quantization methods (of a model loaded quantized) that change linear layers only: those run as their modules
# do, bitsandbytes' 4-bit ones under LoRA inside the fused nodes (lora.py).
QUANTIZATION = frozenset({"bitsandbytes"})


@dataclass(frozen=True)
class Family:
    model_type: str
    module: str                          # the transformers modeling module
    prefix: str                          # of its class names: <prefix>RMSNorm, <prefix>Attention, ...
    config: FrozenSet[str]               # config keys its traits cover, beyond _SHARED
    norm: Norm = Norm.CAST_THEN_WEIGHT
    attention: Attention = Attention()
    rotary: Rotary = Rotary()
    mlp: Mlp = Mlp()
    residual: Residual = PRE_NORM
    head: Head = Head()
    decoder: str = "Model"               # <prefix><decoder>: the decoder's class
    layer: str = ""                      # <prefix><layer>Attention: the infix of the layer's classes (LAYER_PARTS)
    off: Mapping[str, Off] = field(default_factory=dict)  # config key -> Off
    multimodal: Optional[Multimodal] = None
    # <prefix>ForCausalLM exists; Qwen3-VL's language model has no head of its own, only its multimodal model's
    causal_lm: bool = True
    # part -> its class, where that is not <prefix><layer><part>: Qwen2(.5)-VL's text MLP is a Qwen2MLP of their
    # modeling module, whose <prefix>MLP (Qwen2.5-VL's) is the vision tower's
    classes: Mapping[str, str] = field(default_factory=dict)
    # Qwen3.5: the layers config.layer_types calls "linear_attention" mix tokens with a Gated DeltaNet
    # (<prefix>GatedDeltaNet, the layer's `linear_attn`, its output norm a <prefix>RMSNormGated) in place of
    # attention: a causal depthwise conv over the fused q/k/v projection, the gated delta rule over the
    # l2-normed q and k (the value heads sharing key heads in groups), a gated RMSNorm, out_proj.
    linear_attention: bool = False
    # Qwen3-Next: its Gated DeltaNet projects q, k, v and z in one in_proj_qkvz, b and a in one in_proj_ba, each
    # output laid out key head by key head (roles/qwen3_next.py), where Qwen3.5's has a projection each.
    grouped_projections: bool = False
    # LFM2: the layers config.layer_types calls "conv" mix tokens with a gated short convolution
    # (<prefix>ShortConv, the layer's `conv`) in place of attention: in_proj's three chunks B, C, x, then
    # out_proj(C * conv(B * x)), conv a causal depthwise convolution of config.conv_L_cache taps.
    short_conv: bool = False

    @property
    def keys(self) -> FrozenSet[str]:
        return _SHARED | self.config

    @property
    def mixer_types(self) -> Tuple[str, ...]:
        """The layer types whose layers mix tokens otherwise than by attention."""
        return (LINEAR,) * self.linear_attention + (CONV,) * self.short_conv

    def name(self, part: str) -> str:
        """The class name of one of the family's parts: <prefix>RMSNorm, <prefix><layer>MLP, ... (or Family.classes')"""
        return self.classes.get(part) or self.prefix + (self.layer if part in LAYER_PARTS else "") + part


# The parts whose class names carry Family.layer (Gemma4TextAttention, but Gemma4RMSNorm).
LAYER_PARTS = frozenset({"Attention", "MLP", "DecoderLayer", "Experts"})


# Qwen's and OLMoE's routers renormalise where the config's norm_topk_prob says
_NORM_TOPK = Router(renorm="norm_topk_prob")


def _family(model_type: str, prefix: str, config, module: Optional[str] = None, **traits) -> Family:
    return Family(model_type, modeling(module or model_type), prefix, frozenset(config), **traits)


# Gemma 2 and 3: sliding and global layers (their RoPE bases per layer type in rope_parameters), sandwich norms,
# attention scaled by query_pre_attn_scalar, the logits softcapped by final_logit_softcapping.
_GEMMA2 = {"attention_bias", "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation",
           "query_pre_attn_scalar", "use_bidirectional_attention"} | _PER_LAYER
_CAUSAL_WHY = "Bastile's forwards are causal, one way only"
_CAUSAL = {"use_bidirectional_attention": Off(_CAUSAL_WHY)}
_GEMMA4 = {"attention_bias", "attention_k_eq_v", "enable_moe_block", "final_logit_softcapping", "hidden_activation",
           "hidden_size_per_layer_input", "moe_intermediate_size", "num_experts", "num_kv_shared_layers",
           "per_layer_config", "top_k_experts", "use_bidirectional_attention", "use_double_wide_mlp",
           "vocab_size_per_layer_input"} | _PER_LAYER

# Qwen3.5 (partial_rotary_factor: 5.17 also keeps it at the top level, read from rope_parameters)
_QWEN3_5 = {"attention_bias", "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads",
            "linear_num_value_heads", "linear_value_head_dim", "partial_rotary_factor"}
_QWEN3_5_TRAITS = dict(norm=Norm.OFFSET_THEN_CAST, attention=Attention(qk_norm=QkNorm.PER_HEAD, output_gate=True),
                       rotary=Rotary(partial=True, sections=True), decoder="TextModel", linear_attention=True)
_QWEN3_5_MULTIMODAL = frozenset({"image_token_id", "text_config", "tie_word_embeddings", "video_token_id",
                                 "vision_config", "vision_end_token_id", "vision_start_token_id"})
_QWEN3_5_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_token_type_ids",
                   "mm_encoder_outputs")

_QWEN3_VL_TRAITS = dict(attention=Attention(qk_norm=QkNorm.PER_HEAD), rotary=Rotary(sections=True), causal_lm=False)


def _qwen3_vl(model_type: str, prefix: str, output: str) -> Multimodal:
    """Qwen3-VL's multimodal model (its own output class in transformers 5.17, `output` in 5.23)."""
    return Multimodal(model_type, _QWEN3_5_MULTIMODAL, inputs=_QWEN3_5_INPUTS, module=model_type, prefix=prefix,
                      output=("{prefix}CausalLMOutputWithPast", output))


def _qwen2_vl(model_type: str, prefix: str, inputs: Tuple[str, ...] = ()) -> Family:
    """Qwen2-VL's and Qwen2.5-VL's language model (<model_type>_text): Qwen2's layers (q/k/v biases, no q/k norms,
    the window on the layers layer_types says) under multimodal RoPE, whose tables HF's rotary module builds from
    the sections' positions and the attention applies as a plain half-split rotation. No causal LM of its own: the
    head is the multimodal model's, whose inner model takes no labels and Qwen3.5's inputs (+ `inputs`); in
    transformers 5.17 it has its own output class (rope_deltas), in 5.23 HF's."""
    return _family(f"{model_type}_text", prefix, {"max_window_layers", "use_sliding_window"} | _PER_LAYER,
                   module=model_type, attention=Attention(window=Window.LAYER), rotary=Rotary(sections=True),
                   decoder="TextModel", causal_lm=False, classes={"MLP": "Qwen2MLP"},
                   multimodal=Multimodal(model_type, _QWEN3_5_MULTIMODAL, inputs=_QWEN3_5_INPUTS + inputs, labels=False,
                                         output=("{prefix}CausalLMOutputWithPast", "CausalLMOutputWithPast")))


# LFM2's and LFM2-MoE's layers: out_proj, q_layernorm and k_layernorm, no attention dropout; the sublayers' norms
# operator_norm and ffn_norm, the MLP the layer's feed_forward; short convolutions on the "conv" layers.
_LFM2_TRAITS = dict(attention=Attention(qk_norm=QkNorm.PER_HEAD, output="out_proj",
                                        norms=("q_layernorm", "k_layernorm"), dropout=None),
                    residual=Residual(mlp="feed_forward", attention_in="operator_norm", mlp_in="ffn_norm"),
                    short_conv=True)


# Mistral3ForConditionalGeneration (model type mistral3, in a modeling module of its own) holds a Mistral decoder
# (Mistral Small 3.1/3.2, Magistral Small) or a Ministral 3 one (the 2512 checkpoints): its head is held by both
# families' head patches (patch.py).
_MISTRAL3 = Multimodal("mistral3", frozenset({"image_token_index", "multimodal_projector_bias", "projector_hidden_act",
                                              "spatial_merge_size", "text_config", "vision_config",
                                              "vision_feature_layer"}),
                       inputs=("pixel_values", "image_sizes", "vision_feature_layer"), labels=False, module="mistral3",
                       prefix="Mistral3")


FAMILIES: Dict[str, Family] = {f.model_type: f for f in [
    _family("qwen3", "Qwen3", {"attention_bias", "max_window_layers", "use_sliding_window"} | _PER_LAYER,
            attention=Attention(qk_norm=QkNorm.PER_HEAD, window=Window.LAYER)),
    _family("llama", "Llama", {"attention_bias", "mlp_bias", "pretraining_tp"}),
    _family("qwen2", "Qwen2", {"max_window_layers", "use_sliding_window"} | _PER_LAYER,
            attention=Attention(window=Window.LAYER)),
    _family("mistral", "Mistral", {"sliding_window"}, attention=Attention(window=Window.CONFIG),
            multimodal=_MISTRAL3),
    # Layers in mlp_only_layers (or off the decoder_sparse_step) have a dense Qwen3MoeMLP.
    _family("qwen3_moe", "Qwen3Moe",
            {"attention_bias", "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size",
             "norm_topk_prob", "sliding_window", "use_sliding_window"} | _MOE,
            attention=Attention(qk_norm=QkNorm.PER_HEAD, window=Window.LAYER),
            mlp=Mlp(experts="swiglu", router=_NORM_TOPK),
            head=Head(router_aux_loss=True)),
    # Qwen1.5-MoE and Qwen2-MoE: Qwen2's layers (q/k/v biases, qkv_bias; the window on the layers layer_types says)
    # with Qwen3-MoE's routed experts beside a shared expert (a <prefix>MLP) that HF's MoE block gates by a sigmoid;
    # layers in mlp_only_layers (or off the decoder_sparse_step) have a dense <prefix>MLP.
    _family("qwen2_moe", "Qwen2Moe",
            {"decoder_sparse_step", "max_window_layers", "mlp_only_layers", "moe_intermediate_size", "norm_topk_prob",
             "num_experts", "qkv_bias", "shared_expert_intermediate_size", "use_sliding_window"} | _PER_LAYER | _MOE,
            attention=Attention(window=Window.LAYER_TYPE), mlp=Mlp(experts="swiglu", router=_NORM_TOPK),
            head=Head(router_aux_loss=True)),
    # GptOssMLP is the MoE block (router and experts), not a dense MLP. Its experts' GEGLU alpha and limit
    # are module attributes, which the patched gate reads (transformers 5.23 sets them from swiglu_*).
    _family("gpt_oss", "GptOss", {"attention_bias", "swiglu_alpha", "swiglu_limit"} | _PER_LAYER | _MOE,
            norm=Norm.WEIGHT_THEN_CAST, attention=Attention(window=Window.LAYER, sinks=True),
            rotary=Rotary(layout=Layout.HALF_TABLES),
            mlp=Mlp(dense=False, experts="geglu", router=Router(bias=True), router_scores=True),
            head=Head(router_aux_loss=True)),
    _family("mixtral", "Mixtral", {"sliding_window", "router_jitter_noise"} | _MOE,
            attention=Attention(window=Window.CONFIG),
            mlp=Mlp(dense=False, experts="swiglu", router=Router(weights="float32")),
            head=Head(router_aux_loss=True)),
    # Phi-3, Phi-3.5 and Phi-4(-mini): fused projections, partial rotary (rope_parameters'
    # partial_rotary_factor), dropout on the residual branches.
    _family("phi3", "Phi3", {"embd_pdrop", "original_max_position_embeddings", "resid_pdrop", "sliding_window"},
            attention=Attention(fused_qkv=True, window=Window.CONFIG), rotary=Rotary(partial=True),
            mlp=Mlp(fused_gate_up=True, activation="activation_fn"),
            residual=Residual(dropout=("resid_attn_dropout", "resid_mlp_dropout"))),
    _family("smollm3", "SmolLM3",
            {"attention_bias", "mlp_bias", "no_rope_layer_interval", "no_rope_layers", "use_sliding_window"}
            | _PER_LAYER,
            attention=Attention(window=Window.LAYER), rotary=Rotary(layer_flag="use_rope")),
    # attention_multiplier is the attention's scaling and embedding_multiplier scales the embeddings in
    # HF's decoder forward, which Bastile's wraps.
    _family("granite", "Granite",
            {"attention_bias", "attention_multiplier", "embedding_multiplier", "logits_scaling", "mlp_bias",
             "residual_multiplier"},
            residual=Residual(multiplier="residual_multiplier"), head=Head(logit_divisor="logits_scaling")),
    # Granite 3.x MoE (granite-3.1-1b-a400m, -3b-a800m): Granite's multipliers and scaling around Mixtral-style layers,
    # whose MoE block is the layer's block_sparse_moe (its router softmaxes the top-k logits; transformers 5.17's
    # returns the experts first, 5.23's the logits). transformers 5.17 records no router logits for it: its
    # load-balancing loss is no loss of the router's, and a config asking for it is refused before 5.23.
    _family("granitemoe", "GraniteMoe",
            {"attention_bias", "attention_multiplier", "embedding_multiplier", "logits_scaling",
             "residual_multiplier"} | _MOE,
            mlp=Mlp(dense=False, experts="swiglu", router=Router(kind="granitemoe", block=True)),
            residual=Residual(mlp="block_sparse_moe", multiplier="residual_multiplier"),
            head=Head(logit_divisor="logits_scaling", router_aux_loss=True),
            off={"output_router_logits": Off("transformers before 5.23 records no router logits for GraniteMoE, so its "
                                             "load-balancing loss has none of the router's", before="5.23")}),
    _family("ministral3", "Ministral3", {"sliding_window"},
            attention=Attention(window=Window.CONFIG, query_scale=True), multimodal=_MISTRAL3),
    _family("olmo2", "Olmo2", {"attention_bias"}, norm=Norm.WEIGHT_THEN_CAST,
            attention=Attention(qk_norm=QkNorm.FULL_WIDTH), rotary=Rotary(cast_back=True), residual=POST_NORM),
    _family("olmo3", "Olmo3", {"attention_bias"} | _PER_LAYER, norm=Norm.WEIGHT_THEN_CAST,
            attention=Attention(qk_norm=QkNorm.FULL_WIDTH, window=Window.LAYER), rotary=Rotary(cast_back=True),
            residual=POST_NORM),
    # OLMoE: Llama's pre-norm layers and norms, q and k normed over the whole projection width (as OLMo 2, but
    # under Llama's rotation), every layer's MLP routed experts behind a softmax router, with its auxiliary loss.
    _family("olmoe", "Olmoe", {"attention_bias", "clip_qkv", "norm_topk_prob", "num_experts"} | _MOE,
            attention=Attention(qk_norm=QkNorm.FULL_WIDTH), mlp=Mlp(dense=False, experts="swiglu", router=_NORM_TOPK),
            head=Head(router_aux_loss=True), off={"clip_qkv": Off("Bastile's attention does not clamp q, k and v")}),
    # GLM-4.5/4.6/4.7's MoE: HF's sigmoid router (a correction bias, group-limited top-k, routed scaling), a
    # shared expert (a <prefix>MLP) beside the routed ones, the first first_k_dense_replace layers dense; half
    # of each head rotated (half-split), per-head q/k norms where use_qk_norm (GLM-4.5, not Air).
    _family("glm4_moe", "Glm4Moe",
            {"attention_bias", "first_k_dense_replace", "moe_intermediate_size", "n_group", "n_routed_experts",
             "n_shared_experts", "norm_topk_prob", "partial_rotary_factor", "routed_scaling_factor", "topk_group",
             "use_qk_norm"} | _MOE,
            attention=Attention(qk_norm=QkNorm.PER_HEAD, qk_norm_flag="use_qk_norm"), rotary=Rotary(partial=True),
            mlp=Mlp(experts="swiglu", router=Router(kind="glm4_moe", renorm="norm_topk_prob")),
            head=Head(router_logits=True), classes={"TopKRouter": "Glm4MoeTopkRouter"}),
    # ERNIE 4.5 (Baidu): Llama's layers with the interleaved rotation of whole heads on f32 tables, q and k cast back
    # (as GLM-4's pairs, OLMo 2's precision), biases where use_bias; its MoE model (ERNIE-4.5-21B-A3B, 300B-A47B)
    # routes its layers' experts by a softmax router (a correction bias choosing them, the weights renormalised
    # with moe_norm_min) beside a shared expert (a <prefix>MLP), the layers off moe_layer_* dense.
    _family("ernie4_5", "Ernie4_5", {"use_bias"}, rotary=Rotary(layout=Layout.INTERLEAVED, cast_back=True)),
    _family("ernie4_5_moe", "Ernie4_5_Moe",
            {"moe_intermediate_size", "moe_layer_end_index", "moe_layer_interval", "moe_layer_start_index",
             "moe_norm_min", "moe_num_shared_experts", "use_bias"} | _MOE,
            rotary=Rotary(layout=Layout.INTERLEAVED, cast_back=True),
            mlp=Mlp(experts="swiglu", router=Router(kind="ernie4_5_moe")), head=Head(router_aux_loss=True)),
    # partial_rotary_factor is read from rope_parameters (the top-level key is its legacy spelling).
    _family("glm4", "Glm4", {"attention_bias", "partial_rotary_factor"},
            rotary=Rotary(layout=Layout.INTERLEAVED, partial=True),
            mlp=Mlp(fused_gate_up=True, activation="activation_fn"), residual=SANDWICH),
    # Gemma's embeddings are scaled by sqrt(hidden_size) in HF's embedding module, which stays HF's.
    _family("gemma", "Gemma", {"attention_bias", "use_bidirectional_attention"}, norm=Norm.OFFSET_THEN_CAST,
            off=_CAUSAL),
    _family("gemma2", "Gemma2", _GEMMA2, norm=Norm.OFFSET_THEN_CAST,
            attention=Attention(window=Window.LAYER, softcap=True), residual=GEMMA,
            head=Head(softcap="final_logit_softcapping"), off=_CAUSAL),
    # Gemma 3's attention takes no softcap (attn_logit_softcapping is read, never applied, in HF's code), and
    # its q/k norms are Gemma norms. Gemma3ForConditionalGeneration (model type gemma3) holds the same decoder.
    _family("gemma3_text", "Gemma3", _GEMMA2 | {"_sliding_window_pattern"}, module="gemma3",
            norm=Norm.OFFSET_THEN_CAST, attention=Attention(qk_norm=QkNorm.PER_HEAD, window=Window.LAYER),
            residual=GEMMA, head=Head(softcap="final_logit_softcapping"), decoder="TextModel",
            off=_CAUSAL,
            multimodal=Multimodal("gemma3", frozenset({"boi_token_index", "eoi_token_index", "image_token_index", "initializer_range",
                                                       "mm_tokens_per_image", "text_config", "tie_word_embeddings",
                                                       "vision_config"}),
                                  inputs=("pixel_values", "token_type_ids", "mm_encoder_outputs"))),
    # Gemma 4: norms in float32 rounded once (v's without a weight), attention scaled by 1 (q and k are
    # normed), the full layers with their own head_dim and kv heads (per_layer_config: the modules hold them,
    # and the config refuses a value that varies by layer where HF reads one for all) and proportional RoPE
    # (tables as wide as the head, zero past the rotated fraction), per-layer embeddings, K/V shared by the
    # last layers, the logits softcapped; in the MoE model (26B-A4B) experts beside each dense MLP.
    _family("gemma4_text", "Gemma4", _GEMMA4, module="gemma4", norm=Norm.OPTIONAL_WEIGHT_THEN_CAST,
            attention=Attention(qk_norm=QkNorm.PER_HEAD, window=Window.LAYER, shared_kv=True),
            mlp=Mlp(experts="swiglu", beside=True, router=Router(kind="gemma4")), residual=GEMMA4, head=Head(softcap="final_logit_softcapping", output="CausalLMOutputWithPast"),
            decoder="TextModel", layer="Text", classes={"TopKRouter": "Gemma4TextRouter"},
            # "vision": image tokens attend both ways, through the masks HF's multimodal model makes (which
            # Bastile's attention takes); the text decoder alone stays causal.
            off={"use_bidirectional_attention": Off(_CAUSAL_WHY, allowed=("vision",))},
            multimodal=Multimodal("gemma4", frozenset({"audio_config", "audio_token_id", "boa_token_id", "boi_token_id",
                                                       "eoa_token_index", "eoi_token_id", "image_token_id",
                                                       "initializer_range", "text_config", "tie_word_embeddings",
                                                       "video_token_id", "vision_config"}),
                                  inputs=("pixel_values", "pixel_values_videos", "input_features",
                                          "input_features_mask", "image_position_ids", "video_position_ids",
                                          "mm_token_type_ids", "per_layer_inputs"),
                                  softcap=True)),
    # Qwen3.5: three of four layers (config.layer_types) mix tokens with a Gated DeltaNet, the others attend
    # with a sigmoid output gate and (1 + w) q/k norms, a quarter of each head rotated by multimodal RoPE;
    # every norm multiplies by 1 + w. Its MoE model's sparse layers add a gated shared expert (a
    # <prefix>MLP) to the routed ones. Qwen3_5(Moe)ForConditionalGeneration holds the same decoder.
    _family("qwen3_5_text", "Qwen3_5", _QWEN3_5 | {"intermediate_size"}, module="qwen3_5", **_QWEN3_5_TRAITS,
            multimodal=Multimodal("qwen3_5", _QWEN3_5_MULTIMODAL, inputs=_QWEN3_5_INPUTS,
                                  output=("{prefix}CausalLMOutputWithPast", "CausalLMOutputWithPast"))),
    _family("qwen3_5_moe_text", "Qwen3_5Moe",
            _QWEN3_5 | {"moe_intermediate_size", "num_experts", "shared_expert_intermediate_size"} | _MOE,
            module="qwen3_5_moe", **_QWEN3_5_TRAITS, mlp=Mlp(experts="swiglu", router=Router()),
            head=Head(router_aux_loss=True),
            multimodal=Multimodal("qwen3_5_moe", _QWEN3_5_MULTIMODAL, inputs=_QWEN3_5_INPUTS,
                                  output=("{prefix}CausalLMOutputWithPast", "MoeCausalLMOutputWithPast"))),
    # Qwen3-Next (which Qwen3.5 derives from): Qwen3.5's MoE layers (Gated DeltaNets, the gated attention with (1 + w)
    # q/k norms, (1 + w) norms, routed experts beside a gated shared expert) under plain RoPE, a quarter of each head
    # rotated; its Gated DeltaNet's projections grouped by key head; layers in mlp_only_layers (or off the
    # decoder_sparse_step) have a dense <prefix>MLP.
    _family("qwen3_next", "Qwen3Next",
            _QWEN3_5 | {"decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "norm_topk_prob",
                        "num_experts", "shared_expert_intermediate_size"} | _MOE,
            norm=Norm.OFFSET_THEN_CAST, attention=Attention(qk_norm=QkNorm.PER_HEAD, output_gate=True),
            rotary=Rotary(partial=True), mlp=Mlp(experts="swiglu", router=_NORM_TOPK), head=Head(router_aux_loss=True),
            linear_attention=True, grouped_projections=True),
    # Qwen3-VL: Qwen3's layers (per-head q/k norms; in its MoE model Qwen3-MoE's experts, layers in mlp_only_layers
    # or off the decoder_sparse_step dense) under interleaved multimodal RoPE, whose tables HF's rotary module
    # builds from the sections' positions. DeepStack adds the vision tower's intermediate features to the first
    # layers' outputs at the image tokens, between layers, in HF's decoder loop (which Bastile's decoder forward
    # wraps and does not replace). Its classes are Qwen3VL(Moe)Text*, its head is the multimodal model's
    # (Qwen3VL(Moe)ForConditionalGeneration), which takes Qwen3.5's inputs (Qwen3.5 derives from it).
    _family("qwen3_vl_text", "Qwen3VLText", {"attention_bias"}, module="qwen3_vl", **_QWEN3_VL_TRAITS,
            multimodal=_qwen3_vl("qwen3_vl", "Qwen3VL", "CausalLMOutputWithPast")),
    _family("qwen3_vl_moe_text", "Qwen3VLMoeText",
            {"attention_bias", "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "num_experts"} | _MOE,
            module="qwen3_vl_moe", **_QWEN3_VL_TRAITS, mlp=Mlp(experts="swiglu", router=Router()),
            head=Head(router_aux_loss=True),
            multimodal=_qwen3_vl("qwen3_vl_moe", "Qwen3VLMoe", "MoeCausalLMOutputWithPast")),
    # Qwen2.5-VL's multimodal model also takes the videos' seconds per temporal grid step (their RoPE positions'
    # spacing). Its vision blocks' norms are of the text's RMSNorm class (Qwen2_5_VLRMSNorm, as Llama's rounds):
    # they run Bastile's norm too.
    _qwen2_vl("qwen2_5_vl", "Qwen2_5_VL", ("second_per_grid_ts",)),
    _qwen2_vl("qwen2_vl", "Qwen2VL"),
    # LFM2 and LFM2.5 (Liquid AI): gated short convolutions on the layers layer_types calls "conv", attention with
    # per-head q/k norms on the others; each sublayer after its norm (operator_norm, ffn_norm), the MLP the
    # layer's feed_forward (w1, w3, w2 and F.silu). The MLP's width is intermediate_size adjusted by the block_*
    # keys in its __init__ (the module holds it).
    _family("lfm2", "Lfm2", {"block_auto_adjust_ff_dim", "block_ffn_dim_multiplier", "block_multiple_of", "conv_bias",
                             "conv_L_cache", "layer_types", "norm_eps"},
            mlp=Mlp(activation=None, projections=("w1", "w3", "w2")), **_LFM2_TRAITS),
    # LFM2-MoE (LFM2-8B-A1B): LFM2's layers, the first num_dense_layers with LFM2's dense MLP (intermediate_size
    # wide), the others routed experts (their act_fn F.silu, a function) behind HF's sigmoid router (the expert
    # bias choosing the experts, not weighting them; norm_topk_prob, routed_scaling_factor), no auxiliary loss.
    _family("lfm2_moe", "Lfm2Moe", {"conv_bias", "conv_L_cache", "layer_types", "moe_intermediate_size", "norm_eps",
                                    "norm_topk_prob", "num_dense_layers", "num_experts", "num_experts_per_tok",
                                    "routed_scaling_factor", "use_expert_bias"},
            mlp=Mlp(activation=None, projections=("w1", "w3", "w2"), experts="swiglu", expert_activation=None,
                    router=Router(kind="lfm2_moe", renorm="norm_topk_prob")),
            head=Head(router_logits=True), **_LFM2_TRAITS),
]}
# Multimodal model types -> their language model's model type -> its family.
MULTIMODAL: Dict[str, Dict[str, Family]] = {
    mm: {f.model_type: f for f in FAMILIES.values() if f.multimodal and f.multimodal.model_type == mm}
    for mm in {f.multimodal.model_type for f in FAMILIES.values() if f.multimodal}}

LAYER_TYPES = ("full_attention", "sliding_attention")
LINEAR = "linear_attention"  # the layer type of Family.linear_attention's layers
CONV = "conv"  # the layer type of Family.short_conv's layers


class Unsupported(ValueError):
    """A model, or a part of one, that its family's traits do not declare."""


def family_of(model) -> Family:
    """The family of an HF model (by config.model_type; a multimodal one's is its language model's), or
    Unsupported."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in MULTIMODAL:
        text, held = config.get_text_config().model_type, MULTIMODAL[model_type]
        if text not in held:
            raise Unsupported(f"bastile: {model_type} with a {text!r} language model is not supported; Bastile's "
                              f"{model_type} holds {', '.join(sorted(held))}")
        return held[text]
    if model_type not in FAMILIES:
        raise Unsupported(f"bastile: model type {model_type!r} is not supported; "
                          f"supported: {', '.join(sorted([*FAMILIES, *MULTIMODAL]))}")
    return FAMILIES[model_type]


@functools.cache
def reads(module: str) -> FrozenSet[str]:
    """The config keys a transformers modeling module's source reads: `<...>config.key`, `getattr(<...>config,
    "key")` and `hasattr(...)`, `<...>.get_text_config().key`. A key no code reads cannot change what the model
    computes (remote-code leftovers, generation hints, legacy spellings its config class folds into others), so
    only these are compared with a family's traits; read from the installed release, which the patches follow."""
    import ast
    import importlib
    import inspect

    def is_config(node) -> bool:
        if isinstance(node, ast.Call):
            return isinstance(node.func, ast.Attribute) and node.func.attr == "get_text_config"
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
        return name.endswith("config")

    keys = set()
    for node in ast.walk(ast.parse(inspect.getsource(importlib.import_module(module)))):
        if isinstance(node, ast.Attribute) and is_config(node.value):
            keys.add(node.attr)
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
              and len(node.args) >= 2 and is_config(node.args[0]) and isinstance(node.args[1], ast.Constant)):
            keys.add(node.args[1].value)
    return frozenset(keys)


def _check_quantization(family: Family, quantizer) -> None:
    """The model's weights as loaded (its hf_quantizer: None where they are not quantized, as in a model made from
    a config, or a checkpoint dequantized on load, whose config keeps or drops quantization_config accordingly)."""
    if quantizer is None:
        return
    method = quantizer.quantization_config.quant_method
    method = getattr(method, "value", method)  # an enum in transformers' quantization configs
    if method not in QUANTIZATION:
        hint = ("; load it dequantized for training: quantization_config=Mxfp4Config(dequantize=True)"
                if method == "mxfp4" else "")
        raise Unsupported(f"bastile: {family.model_type} quantized with {method!r}: Bastile knows "
                          f"{sorted(QUANTIZATION)} only{hint}")


def _check_config(family: Family, config) -> None:
    from transformers import PretrainedConfig
    from .versions import installed_before
    if family.mlp.experts and getattr(getattr(config, "distributed_config", None), "enable_expert_parallel", False):
        raise Unsupported(f"bastile: {family.model_type} with expert parallelism (distributed_config."
                          "enable_expert_parallel): Bastile's expert path runs every expert on each rank")
    keys = set(config.to_dict()) - set(PretrainedConfig().to_dict())
    read = reads(family.module)
    mm = family.multimodal
    if mm and config.model_type == mm.model_type:
        unknown = sorted((keys - mm.config) & (reads(modeling(mm.module)) if mm.module else read))
        if unknown:
            raise Unsupported(f"bastile: config of {config.model_type} has {unknown}, which its transformers modeling "
                              f"code reads and Bastile's {family.model_type} traits do not declare")
        return _check_config(family, config.text_config)
    unknown = sorted((keys - family.keys) & read)
    if unknown:
        raise Unsupported(f"bastile: config of {family.model_type} has {unknown}, which its transformers modeling "
                          f"code reads and Bastile's {family.model_type} traits do not declare (a newer transformers, "
                          "or a flag added to the config)")
    if getattr(config, "is_causal", True) is not True:  # read by the masks HF makes for every family
        raise Unsupported(f"bastile: {family.model_type} with is_causal={config.is_causal!r}: {_CAUSAL_WHY}")
    for key, off in family.off.items():
        value = getattr(config, key, None)
        if value and value not in off.allowed and (off.before is None or installed_before(off.before)):
            raise Unsupported(f"bastile: {family.model_type} with {key}={value!r}: {off.why}")
    rope = config.rope_parameters or {}
    tables = rope.values() if set(rope) <= set(LAYER_TYPES) and rope else [rope]
    for t in tables:
        factor = (t or {}).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        # proportional RoPE's tables are as wide as the head (zero frequencies past the factor): whole heads rotate
        if factor not in (None, 1.0) and not family.rotary.partial and (t or {}).get("rope_type") != "proportional":
            raise Unsupported(f"bastile: {family.model_type} with partial_rotary_factor={factor}: Bastile's "
                              f"{family.model_type} traits rotate whole heads")
    if "layer_types" in family.config:
        known = LAYER_TYPES + family.mixer_types
        types = set(config.layer_types or ())
        if not types <= set(known):
            raise Unsupported(f"bastile: {family.model_type} layer_types {sorted(types - set(known))} "
                              f"are not among {list(known)}")


def _wrapper_of(t: type, cls: type) -> bool:
    """Whether t is the class torch.distributed makes to wrap cls in place (FSDP2's FSDP<cls>): its own
    wrapper's methods over cls, none of the model's."""
    return len(t.__bases__) == 2 and t.__bases__[1] is cls and t.__bases__[0].__module__.startswith("torch.distributed")


def check(model, parts: Callable[[Family], Iterable[str]]) -> Family:
    """The model's family, after checking that the model is what the family declares; Unsupported, naming
    what is not, otherwise. Checks its weights' quantization, the config (declared keys, rotation and layer
    types in range) and every module: none may be a subclass of a class whose forward Bastile replaces or calls
    into, `parts(family)` (its overrides and attributes would be skipped or misread)."""
    import importlib
    family = family_of(model)
    _check_quantization(family, getattr(model, "hf_quantizer", None))
    _check_config(family, model.config)
    module = importlib.import_module(family.module)
    # A class the library lacks is no target: apply() names it after this check
    classes = [c for part in dict.fromkeys(parts(family)) if (c := getattr(module, family.name(part), None))]
    for name, module in model.named_modules():
        for cls in classes:
            if isinstance(module, cls) and type(module) is not cls and not _wrapper_of(type(module), cls):
                raise Unsupported(f"bastile: {name or 'the model'} is a {type(module).__qualname__}, a subclass "
                                  f"of {cls.__name__} that Bastile's {family.model_type} traits do not declare")
    return family
