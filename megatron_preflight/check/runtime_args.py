"""A run's args, from a Megatron ``Namespace``, from ``pretrain_gpt.py`` flags, or from YAML — one typed object.

Flags use Megatron's own names; unknown flags are ignored; Megatron's derived defaults are applied (ffn = 4·hidden,
or the SwiGLU default; kv_channels = hidden / heads; query groups = heads without GQA; ETP follows TP; VPP from
``--num-layers-per-virtual-pipeline-stage`` or ``--num-virtual-stages-per-pipeline-rank``; padded vocab).
Needs neither megatron.training nor megatron.core.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from megatron_preflight import parallel
from megatron_preflight.errors import PreflightError
from megatron_preflight.parallel import VOCAB_DIVISOR, pad_vocab


@dataclass(init=False, repr=False)  # both written below: dataclass's cost ~3 ms (__init__) and 1.3 ms to compile
class RuntimeArgs:
    """The args of the run about to start (Megatron's attribute names). None = not given / unknown."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    context_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    num_virtual_stages_per_pipeline_rank: int | None = None
    virtual_pipeline_model_parallel_size: int | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    pipeline_model_parallel_layout: str | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    num_layers: int | None = None
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    num_attention_heads: int | None = None
    group_query_attention: bool = False
    num_query_groups: int | None = None
    kv_channels: int | None = None
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_grouped_gemm: bool = False
    vocab_size: int | None = None
    padded_vocab_size: int | None = None
    null_tokenizer_adds_eod: bool | None = None  # the release's NullTokenizer (check/releases.py); None: not known
    make_vocab_size_divisible_by: int = VOCAB_DIVISOR
    max_position_embeddings: int | None = None
    seq_length: int | None = None
    position_embedding_type: str = "learned_absolute"
    normalization: str = "LayerNorm"
    swiglu: bool = False
    add_bias_linear: bool = True
    qk_layernorm: bool = False
    # what a Hugging Face model fixes and a Megatron checkpoint may change (check/hf_model.py); Megatron's defaults
    rotary_base: float = 10000
    rotary_percent: float = 1.0
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rotary_seq_len_interpolation_factor: int | None = None
    norm_epsilon: float = 1e-5  # --norm-epsilon (saved as layernorm_epsilon by Megatron-LM main)
    add_qkv_bias: bool = False
    moe_router_pre_softmax: bool = False
    moe_router_score_function: str = "softmax"
    moe_layer_freq: str | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_router_dtype: str | None = None
    moe_latent_size: int | None = None
    trust_remote_code: bool = False  # (the HuggingFace tokenizer's own code may run)
    rope_type: str | None = None  # MLA's default is yarn
    rotary_scaling_factor: float = 1.0  # YaRN (MLA)
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # YaRN on a GPT model (Megatron-LM main), Megatron's effective defaults
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_correction_range_round_to_int: bool = True
    # GPT-OSS's attention sinks, sliding window (``W,0``; the layers: an int frequency or a 0/1 list, as given) and
    # clamped quick GEGLU with a linear offset
    softmax_type: str = "vanilla"
    window_size: str | None = None
    window_attn_skip_freq: str | None = None
    quick_geglu: bool = False
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    multi_latent_attention: bool = False  # MLA, and its sizes (Megatron's defaults)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    mtp_num_layers: int | None = None  # multi-token prediction layers
    # HybridModel (pretrain_hybrid.py): the layer pattern (Megatron derives num_layers, VPP and the MTP depths from
    # it), and the Mamba-2 / gated delta net sizes TP must divide
    hybrid_layer_pattern: str | None = None
    hybrid_override_pattern: str | None = None  # its older name
    mamba_num_heads: int | None = None
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_state_dim: int = 128
    mamba_expand: int = 2
    squared_relu: bool = False  # the MLP's activation: ReLU squared (NemotronH) instead of GELU / SwiGLU
    apply_layernorm_1p: bool = False  # zero-centred norm weights (Qwen3-Next)
    attention_output_gate: bool = False  # a sigmoid gate on the attention's output (Qwen3-Next)
    moe_shared_expert_gate: bool = False  # a sigmoid gate on the shared expert (Qwen3-Next)
    linear_conv_kernel_dim: int = 4  # a gated delta net's convolution taps
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None  # (Megatron's defaults: 128 and 128; None: not given)
    linear_value_head_dim: int | None = None
    untie_embeddings_and_output_weights: bool = False
    transformer_impl: str = "transformer_engine"
    # The run's Adam: "torch" (AdamW) or "fused" (TE's or apex's FusedAdam). Not a Megatron flag: Megatron takes the
    # one installed; the hook reads it from the run, the CLI from --optimizer-family (None: unknown, not compared).
    optimizer_family: str | None = None
    # Whether the run builds the legacy GroupedMLP (local spec + --moe-grouped-gemm on a megatron-core that has it);
    # not a flag: the hook asks megatron.core, the CLI does not know (None)
    builds_grouped_mlp: bool | None = None
    # What this Megatron names an MTP layer's transformer layer in a state dict (``mtp_model_layer`` from
    # megatron-core 0.17, ``transformer_layer`` before); not a flag: the hook asks megatron.core, offline the release
    # table (check/releases.py) when the release is known, else None (not compared)
    mtp_layer_name: str | None = None
    # What this Megatron-FSDP names an MTP layer's transformer layer among the model tensors of an fsdp_dtensor file
    # (the module's name up to megatron-core 0.19; main maps it back to ``transformer_layer``); the hook asks
    # megatron.core, offline the release table; None: unknown (not compared)
    fsdp_mtp_layer_name: str | None = None
    # What this Megatron names a Mamba mixer's conv in a state dict (``conv1d_weight`` from megatron-core 0.19,
    # ``conv1d.weight`` before); the hook and the CLI take it from the release table (check/releases.py)
    mamba_conv_name: str | None = None
    # Whether the run's Megatron adds a local-spec expert's output bias in place (check/releases.py: 0.15 on); the
    # hook and the CLI take it from the release table; None: unknown (not judged)
    expert_bias_in_place: bool | None = None
    # Whether the run's megatron-core loads ShardedTensors with a flattened_range (the distributed optimizer's
    # fully_sharded_model_space form; megatron-core >= 0.16 does not); the hook asks megatron.core, None offline
    loads_flattened_range: bool | None = None
    # The per-group settings by which the run's megatron.core pairs saved optimizer param groups with its own
    # (``param_group_identifier_keys``; check/param_groups.py); the hook asks megatron.core, None offline
    param_group_keys: tuple[str, ...] | None = None
    use_distributed_optimizer: bool = False
    # --optimizer (Megatron's default adam; sgd; Megatron-LM main's emerging ones: muon, adaptive_muon, lion, soap, and
    # their layer-wise dist_ forms) and the scalar optimizer of a Muon run (layout/optimizer_kinds.py)
    # Generalized tensor parallelism (Megatron-LM main, 2026): each weight split into this many shards over TP x GTP
    # (None: TP, no GTP); the same for the expert layers over ETP x expert GTP
    tensor_parallel_num_weight_shards: int | None = None
    expert_tensor_parallel_num_weight_shards: int | None = None
    optimizer: str = "adam"
    muon_scalar_optimizer: str = "adam"
    overlap_grad_reduce: bool = False  # the DDP bucketing (check/ddp_buckets.py)
    ddp_bucket_size: int | None = None
    ckpt_format: str = "torch_dist"
    use_megatron_fsdp: bool = False  # Megatron-FSDP: reads and writes fsdp_dtensor only (check/fsdp.py)
    data_parallel_sharding_strategy: str = "no_shard"
    auto_detect_ckpt_format: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    use_checkpoint_args: bool = False
    use_mp_args_from_checkpoint_args: bool = False
    bf16: bool = False
    fp16: bool = False
    sequence_parallel: bool = False
    load: str | None = None
    ckpt_step: int | None = None
    exit_on_missing_checkpoint: bool = False
    world_size: int | None = None
    use_tp_pp_dp_mapping: bool = False
    # the LR schedule and the horizon (check/schedule.py); Megatron's defaults, None = not set / not known
    lr: float | None = None
    min_lr: float = 0.0
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    lr_decay_style: str = "linear"
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_fraction: float | None = None
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    train_iters: int | None = None
    train_samples: int | None = None
    global_batch_size: int | None = None
    weight_decay: float = 0.01
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = "constant"
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    skip_train: bool = False
    # the batch size at the checkpoint's consumed samples (check/batches.py)
    step_batch_size_schedule: str | None = None
    rampup_batch_size: list[str] | None = None  # START INCR SAMPLES (older Megatron)
    decrease_batch_size_if_needed: bool = False
    # the first save (check/save.py)
    save: str | None = None
    save_interval: int | None = None
    async_save: bool = False
    use_persistent_ckpt_worker: bool = False
    non_persistent_save_interval: int | None = None
    non_persistent_ckpt_type: str | None = None
    non_persistent_global_ckpt_dir: str | None = None
    non_persistent_local_ckpt_dir: str | None = None
    # the data (check/data.py): Megatron's --data-path forms (None: not given)
    data_path: list[str] | None = None
    train_data_path: list[str] | None = None
    valid_data_path: list[str] | None = None
    test_data_path: list[str] | None = None
    data_args_path: str | None = None
    per_split_data_args_path: str | None = None  # JSON: {"train": [...], "valid": [...], "test": [...]}
    mock_data: bool = False
    data_cache_path: str | None = None
    # the tokenizer's files (check/tokenizer.py)
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    # memory (check/memory.py)
    micro_batch_size: int | None = None
    recompute_granularity: str | None = None
    accumulate_allreduce_grads_in_fp32: bool = False
    preflight_device_memory: float | None = None  # GiB: the device to fit (the hook also asks the device)
    given: set[str] = field(default_factory=set)  # fields the user set explicitly

    def __init__(self, **values: Any) -> None:
        """Every field its default, then ``values`` by name (a record of ~150 fields is never built by position)."""
        unknown = values.keys() - _DEFAULTS.keys() - {"given"}
        if unknown:
            raise TypeError(f"RuntimeArgs has no field {', '.join(sorted(unknown))}")
        self.__dict__.update(_DEFAULTS)
        self.given = set()
        self.__dict__.update(values)

    def __repr__(self) -> str:
        """The fields that differ from their defaults (the other ~120 say nothing)."""
        given = []
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            value = getattr(self, f.name)
            if value != default:
                given.append(f"{f.name}={value!r}")
        return f"RuntimeArgs({', '.join(given)})"

    # -- derived values ------------------------------------------------------------------------------------------
    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def vpp(self) -> int | None:
        return self.virtual_pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def data_parallel_size(self) -> int | None:
        if not self.world_size:
            return None
        return self.world_size // (self.tp * self.pp * self.cp)

    def derive(self) -> "RuntimeArgs":
        """Apply Megatron's derived defaults (as ``validate_args`` and the tokenizer do). Idempotent. A size that is
        not a positive integer is a usage error, raised here, before anything divides by it."""
        parallel.validate_sizes(self)
        if self.num_attention_heads and self.hidden_size and self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if not self.group_query_attention and self.num_attention_heads:
            self.num_query_groups = self.num_attention_heads
        elif self.num_query_groups is None:
            self.num_query_groups = 1
        if self.ffn_hidden_size is None and self.hidden_size:
            if self.swiglu:
                self.ffn_hidden_size = int((4 * self.hidden_size * 2 / 3) / 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_experts and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.max_position_embeddings is None and self.seq_length is not None:
            self.max_position_embeddings = self.seq_length
        pattern = parallel.hybrid_pattern(self)
        if pattern is not None:  # as validate_args: the pattern decides the layers and the MTP depths
            self.hybrid_layer_pattern = pattern
            self.num_layers = len(parallel.hybrid_layers(pattern))
            depths = pattern.count(parallel.MTP_SEPARATOR)
            if depths and pattern.split(parallel.MTP_SEPARATOR)[-1]:
                self.mtp_num_layers = depths
        try:  # an impossible split is reported by the check (parallel.LayoutError), not here
            self.virtual_pipeline_model_parallel_size = parallel.derive_vpp(self)
        except parallel.LayoutError:
            self.virtual_pipeline_model_parallel_size = None
        if self.padded_vocab_size is None and self.vocab_size:
            self.padded_vocab_size = pad_vocab(self.tokenizer_ids(), self.make_vocab_size_divisible_by, self.tp)
        return self

    def tokenizer_ids(self) -> int:
        """The run's token ids (its ``--vocab-size``, with the end-of-document id NullTokenizer adds where the release
        does: :func:`parallel.tokenizer_ids`)."""
        return parallel.tokenizer_ids(self.vocab_size or 0, self.tokenizer_type,
                                      null_adds_eod=self.null_tokenizer_adds_eod is not False)

    def layout(self) -> parallel.ParallelLayout:
        """The run's parallel layout (the one builder, :func:`parallel.from_args`)."""
        return parallel.from_args(self)


_FIELDS = {f.name: f for f in dataclasses.fields(RuntimeArgs) if f.name != "given"}
_DEFAULTS = {name: f.default for name, f in _FIELDS.items()}  # (each has one: none is a factory but `given`)
# Flags that set a boolean field to the opposite of its flag name.
_NEGATIVE_FLAGS = {"--disable-bias-linear": "add_bias_linear"}
_ALIASES = {"--nproc": "world_size", "--nproc-per-node": "world_size", "--nproc_per_node": "world_size"}


def from_namespace(ns: Any) -> RuntimeArgs:
    """From a Megatron args ``Namespace`` (or any object with those attributes)."""
    values = vars(ns) if hasattr(ns, "__dict__") else dict(ns)
    return from_mapping(values)


def from_mapping(values: dict[str, Any]) -> RuntimeArgs:
    args = RuntimeArgs()
    for name, value in values.items():
        key = name.replace("-", "_")
        if key == "disable_bias_linear":
            key, value = "add_bias_linear", not bool(value)
        if key == "layernorm_epsilon":  # Megatron-LM main's name for --norm-epsilon
            key = "norm_epsilon"
        if key == "layernorm_zero_centered_gamma":  # Megatron-LM main's name for --apply-layernorm-1p
            key = "apply_layernorm_1p"
            if not value and values.get("apply_layernorm_1p"):
                continue
        if key in _FIELDS and value is not None:
            setattr(args, key, _coerce(key, value))
            args.given.add(key)
    if "params_dtype" in values and values["params_dtype"] is not None:
        text = str(values["params_dtype"])
        args.bf16 = args.bf16 or "bfloat16" in text
        args.fp16 = args.fp16 or "float16" in text and "bfloat16" not in text
    return args.derive()


def _coerce(key: str, value: Any) -> Any:
    default = _FIELDS[key].default
    typ = _FIELDS[key].type
    if isinstance(default, bool) or typ == "bool":
        if isinstance(value, str):
            return value.lower() in ("1", "true", "yes", "on")
        return bool(value)
    if "float" in str(typ) and not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise PreflightError(f"argument {key} must be a number, got {value!r}", fix=f"pass a number for {key}",
                                 code="usage") from None
    if key in ("window_size", "window_attn_skip_freq"):  # (a tuple / list / int from a Namespace, text from flags)
        text = ",".join(str(int(v)) for v in value) if isinstance(value, (list, tuple)) else str(value)
        text = text.replace(" ", "")
        return text.strip("()[]") if re.fullmatch(r"[\[(]?[\d,]*[\])]?", text) else text  # (a pattern: as given)
    if "tuple" in str(typ):  # a list of names: "a,b" on the command line
        items = value.split(",") if isinstance(value, str) else value
        return tuple(str(v).strip() for v in items if str(v).strip())
    if "int" in str(typ) and not isinstance(value, bool):
        try:
            return int(value)
        except (TypeError, ValueError):
            raise PreflightError(f"argument {key} must be an integer, got {value!r}", fix=f"pass an integer for {key}",
                                 code="usage") from None
    return value


class _FlagParser(argparse.ArgumentParser):
    """The run's flags: a malformed one is one usage line naming it (never argparse's usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        m = re.search(r"argument (--[\w-]+)(?:/--[\w-]+)*: (.*)", message)
        flag, why = (m.group(1), m.group(2)) if m else ("a flag", message)
        raise PreflightError(f"the run's flag {flag}: {why}", fix=f"give {flag} its value, e.g. {flag} 2",
                             code="usage")


class _Formatter(argparse.HelpFormatter):
    """argparse makes a formatter for each flag it is given (to check the flag's metavar), and the stock one asks
    the terminal's size each time: ~2 ms of the ~170 flags here. This parser prints no help."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=80)


def _parser() -> argparse.ArgumentParser:
    p = _FlagParser(add_help=False, allow_abbrev=False, formatter_class=_Formatter)
    for name, f in _FIELDS.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(flag, dest=name, action="store_true", default=None)
        elif "list" in str(f.type):
            p.add_argument(flag, dest=name, nargs="+", default=None)
        else:
            p.add_argument(flag, dest=name, default=None)
    p.add_argument("--disable-bias-linear", dest="disable_bias_linear", action="store_true", default=None)
    p.add_argument("--no-yarn-correction-range-round-to-int", dest="yarn_correction_range_round_to_int",
                   action="store_false", default=None)
    for old in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):  # Megatron's old spelling
        p.add_argument("--" + old.replace("_", "-").replace("opt-param", "opt_param"), dest=old, action="store_true",
                       default=None)
    for alias, dest in _ALIASES.items():
        p.add_argument(alias, dest=f"alias_{dest}_{alias}", default=None)
    p.add_argument("--nnodes", dest="nnodes", default=None)
    p.add_argument("--yaml-cfg", dest="yaml_cfg", default=None)
    return p


def from_cli(argv: list[str], env: dict[str, str] | None = None) -> RuntimeArgs:
    """From ``pretrain_gpt.py`` flags. Unknown flags are ignored. World size: ``--world-size``, ``--nproc``
    (× ``--nnodes``), or the torchrun env (``WORLD_SIZE``)."""
    env = dict(os.environ if env is None else env)
    ns, _unknown = _parser().parse_known_args(argv)
    values = {k: v for k, v in vars(ns).items() if v is not None and not k.startswith("alias_")}
    nnodes = int(values.pop("nnodes", 1) or 1)
    yaml_cfg = values.pop("yaml_cfg", None)
    for k, v in vars(ns).items():
        if k.startswith("alias_") and v is not None:
            values["world_size"] = int(v) * nnodes
    if "world_size" not in values and env.get("WORLD_SIZE"):
        values["world_size"] = env["WORLD_SIZE"]
    if yaml_cfg:
        merged = _yaml_values(yaml_cfg)
        merged.update(values)
        values = merged
    return from_mapping(values)


def _yaml_values(path: str) -> dict[str, Any]:
    import yaml  # deferred: only a run configured by YAML needs it

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as exc:
        raise PreflightError(f"cannot read the YAML config ({exc.strerror})", path=path, code="usage") from None
    except yaml.YAMLError as exc:
        raise PreflightError(f"the YAML config is not valid YAML ({exc})", path=path, code="usage") from None
    if not isinstance(data, dict):
        raise PreflightError("the YAML config must be a mapping of Megatron arg names to values", path=path,
                             code="usage")
    flat: dict[str, Any] = {}

    def walk(d: dict[str, Any]) -> None:  # Megatron's --yaml-cfg nests sections (e.g. model_parallel: {...})
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v)
            else:
                flat[str(k)] = v

    walk(data)
    return flat


def from_yaml(path: str, overrides: list[str] | None = None, env: dict[str, str] | None = None) -> RuntimeArgs:
    """From a YAML file of Megatron arg names (``--config run.yaml``); command-line flags override it."""
    values = _yaml_values(path)
    if overrides:
        cli = from_cli(overrides, env)
        values.update({k: getattr(cli, k) for k in cli.given})
    elif env and env.get("WORLD_SIZE") and "world_size" not in values:
        values["world_size"] = env["WORLD_SIZE"]
    return from_mapping(values)
