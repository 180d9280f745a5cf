"""THE table of optimizer kinds: what each keeps per parameter, and how each field follows a layout change.

Megatron-LM trains with ``--optimizer adam | sgd`` (torch's, or TE's / apex's fused Adam) and, on main, with the
emerging optimizers of NVIDIA's ``emerging-optimizers`` package (``muon``, ``adaptive_muon``, ``lion``, ``soap``; a
``dist_`` prefix is the layer-wise distributed form). An emerging optimizer owns the 2-D weight matrices only; the
rest (1-D tensors, the word embedding and the output layer, and for Muon the tensors marked ``use_muon=False``: a
Mamba mixer's ``in_proj``) goes to a scalar optimizer (Adam, or ``--muon-scalar-optimizer``), and the saved state is
a chain of the two: each param group of the scalar part carries ``optimizer: <name>``, the emerging part's do not.

How a field follows a layout change (:class:`Split`):

* ``PARAM`` — a tensor of its parameter's shard shape (Adam's moments, a momentum buffer): split as its parameter;
* ``STEP`` — a per-parameter scalar (torch's Adam and SOAP's ``step``): carried;
* ``LOCAL`` — a matrix of the shard's own (SOAP's Kronecker factors ``L``, ``R`` and eigenbases ``Q_L``, ``Q_R``; a
  NorMuon second moment reduced along one dim of the shard): carried exactly only where the parameter's shard is the
  same at the target; anything else cannot be rebuilt from the shards and is refused (weights only is the way on).

A field that no kind names is an error, never dropped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from megatron_preflight.errors import PreflightError


class Split(enum.Enum):
    PARAM = "param"
    STEP = "step"
    LOCAL = "local"
    PARAM_OR_LOCAL = "param or local"  # param-shaped: PARAM; any other shape: LOCAL


@dataclass(frozen=True)
class Kind:
    """One optimizer: its per-parameter state fields and what it costs."""

    name: str  # Megatron's --optimizer value (without the layer-wise dist_ prefix)
    fields: dict[str, Split]
    state_bytes: int  # fp32 state bytes per parameter element (the masters are counted apart)
    emerging: bool = False  # built by Megatron-LM main's emerging-optimizer path (chained with a scalar optimizer)
    honours_use_muon: bool = False  # a tensor marked use_muon=False goes to the scalar optimizer
    exact_note: str = ""  # what cannot be carried across a change of a parameter's shard
    optional: tuple[str, ...] = ()  # fields a state may lack (an option's: amsgrad's max_exp_avg_sq)
    # Megatron's distributed optimizer: the fields its flat buffers hold beside the fp32 master ``param`` (empty: it
    # does not run this kind)
    distributed_fields: tuple[str, ...] = ()
    step_tensor: bool = False  # its per-parameter ``step`` is a tensor (torch's Adam), not a number
    stateless_allowed: bool = False  # a parameter may have no state at all (SGD with --sgd-momentum 0)
    torch_dist_loads: bool = True  # Megatron's own torch_dist load of its plain (model-space) state works
    fused_form: bool = False  # Transformer Engine / apex build a fused form of it (FusedAdam: step in its groups)

    def rule(self, field: str, where: str = "") -> Split:
        """How ``field`` of this kind's state follows a layout change; raises for a field the table does not name."""
        rule = self.fields.get(field)
        if rule is None:
            raise _unknown(f"the {self.name} optimizer state holds a field {field!r} that megatron-preflight does not "
                           f"know how to carry (it knows {', '.join(self.fields)})", where)
        return rule

    @property
    def moments(self) -> tuple[str, ...]:
        """The fields split as the parameter that every parameter of this kind must have saved."""
        return tuple(n for n, r in self.fields.items() if r == Split.PARAM and n not in self.optional)

    @property
    def param_fields(self) -> tuple[str, ...]:
        """Every field split as the parameter (the required ones and the optional ones)."""
        return tuple(n for n, r in self.fields.items() if r == Split.PARAM)

    @property
    def has_local(self) -> bool:
        return any(r in (Split.LOCAL, Split.PARAM_OR_LOCAL) for r in self.fields.values())

    def describe(self) -> str:
        return f"{self.name} ({', '.join(n for n in self.fields if n not in self.optional)})"


class OptimizerNotReshardable(PreflightError):
    """The optimizer state cannot be mapped to parameters safely (or is of a kind, or holds a field, that the table
    does not know)."""


def _unknown(message: str, where: str) -> OptimizerNotReshardable:
    return OptimizerNotReshardable(message, path=where or None, code="optimizer",
                                   fix="start the run with --no-load-optim (weights only), or reshard offline with "
                                       "--drop-optimizer")


_P, _S, _L = Split.PARAM, Split.STEP, Split.LOCAL
KINDS: dict[str, Kind] = {k.name: k for k in (
    # (max_exp_avg_sq: torch's amsgrad; master_param: TE's FusedAdam keeping fp32 masters or their remainders)
    Kind("adam", {"step": _S, "exp_avg": _P, "exp_avg_sq": _P, "max_exp_avg_sq": _P, "master_param": _P}, 8,
         optional=("max_exp_avg_sq", "master_param"), distributed_fields=("exp_avg", "exp_avg_sq"), step_tensor=True,
         fused_form=True),
    # (no buffer at all with --sgd-momentum 0; Megatron's torch_dist load of its state fails after the build: 'TypeError:
    # NoneType object is not callable', SGD has no init_state_fn in its sharded_state_dict)
    Kind("sgd", {"momentum_buffer": _P}, 4, stateless_allowed=True, torch_dist_loads=False),
    Kind("lion", {"exp_avg": _P}, 4, emerging=True),
    Kind("muon", {"momentum_buffer": _P}, 4, emerging=True, honours_use_muon=True),
    Kind("adaptive_muon", {"momentum_buffer": _P, "moment2_buffer": Split.PARAM_OR_LOCAL}, 8, emerging=True,
         honours_use_muon=True, exact_note="a NorMuon / NAMO second moment is reduced over its shard"),
    Kind("soap", {"step": _S, "exp_avg": _P, "exp_avg_sq": _P, "L": _L, "R": _L, "Q_L": _L, "Q_R": _L}, 8,
         emerging=True, exact_note="SOAP's preconditioners (L, R, Q_L, Q_R) are matrices of each shard's own rows "
                                   "and columns"),
)}
_ALIASES = {"adamw": "adam"}
MASTER_BYTES = 4  # the fp32 master copy a bf16 / fp16 run's optimizer keeps per parameter element
MASTER_FIELD = "param"  # the distributed optimizer's name for it in its flat buffers
# the kind Megatron's distributed optimizer runs (Adam), and the fields of its flat buffers, master first
DISTRIBUTED = next(k for k in KINDS.values() if k.distributed_fields)
DISTRIBUTED_STATE = (MASTER_FIELD, *DISTRIBUTED.distributed_fields)

# parameters an emerging optimizer never owns (Megatron marks them is_embedding_or_output_parameter)
_EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")
_NO_MUON = (".mixer.in_proj.weight", ".mixer.in_proj.bias")  # Mamba / gated delta net: use_muon=False


def kind_named(name: str | None, where: str = "") -> Kind:
    """The kind of ``--optimizer name`` (None: Adam, Megatron's default; ``dist_muon``: Muon's layer-wise form)."""
    bare = (name or "adam").lower()
    bare = _ALIASES.get(bare.removeprefix("dist_"), bare.removeprefix("dist_"))
    kind = KINDS.get(bare)
    if kind is None:
        raise _unknown(f"the checkpoint was trained with --optimizer {name}, whose state megatron-preflight does not "
                       f"know (it knows {', '.join(KINDS)})", where)
    return kind


def primary_of(saved_args: Any) -> Kind:
    """The optimizer a checkpoint was trained with, from its saved args (an args namespace or a dict)."""
    name = saved_args.get("optimizer") if isinstance(saved_args, dict) else getattr(saved_args, "optimizer", None)
    return kind_named(name if isinstance(name, str) else None)


def layer_wise(saved_args: Any) -> bool:
    """Whether the run used the layer-wise distributed optimizer (``--optimizer dist_<name>`` or
    ``--use-layer-wise-distributed-optimizer``): its state is per DP rank, in files of its own."""
    get = saved_args.get if isinstance(saved_args, dict) else (lambda k: getattr(saved_args, k, None))
    name = get("optimizer")
    return bool(get("use_layer_wise_distributed_optimizer")) or (isinstance(name, str) and name.startswith("dist_"))


def group_kind(settings: dict[str, Any], primary: Kind) -> Kind:
    """The kind of one param group: a scalar optimizer's groups name it (``optimizer: adam``), the primary's do not."""
    name = settings.get("optimizer")
    return kind_named(name) if isinstance(name, str) else primary


def goes_to_scalar(key: str, shape: tuple[int, ...], primary: Kind) -> bool:
    """Whether the parameter ``key`` of ``shape`` is handed to the scalar optimizer of an emerging one's chain."""
    if not primary.emerging:
        return False
    if len(shape) != 2 or key.endswith(_EMBEDDING_OR_OUTPUT):
        return True
    return primary.honours_use_muon and key.endswith(_NO_MUON)


def kinds_of(settings: list[dict[str, Any]], primary: Kind) -> list[Kind]:
    """The distinct kinds of these param groups, in the order first met (a chain's parts, in Megatron's order)."""
    out: list[Kind] = []
    for s in settings:
        k = group_kind(s, primary)
        if k not in out:
            out.append(k)
    return out


def describe_chain(saved_args: Any, settings: list[dict[str, Any]] | None) -> str:
    """What the state holds per parameter, by kind: ``adam (step, exp_avg, exp_avg_sq)``, or an emerging
    optimizer's chain ``muon (momentum_buffer) for the weight matrices + adam (...) for the rest``."""
    primary = primary_of(saved_args or {})
    kinds = kinds_of(settings, primary) if settings else [primary]
    if len(kinds) == 1:
        return kinds[0].describe()
    rest = [k for k in kinds if k != primary]
    return f"{primary.describe()} for the weight matrices + " + " + ".join(k.describe() for k in rest) + \
        " for the rest"
