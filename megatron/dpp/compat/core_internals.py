"""The megatron.core internals megatron/dpp relies on, and the machinery that declares and
checks such dependencies (the trainer's own are declared in
megatron/trainer/core_compat/core_overrides.py with the same machinery, and `verify()` checks
both lists at the trainer's start-up).

megatron-core's public API is what is constructed by keyword (TransformerConfig,
OptimizerConfig, ...): a renamed keyword there fails with Python's own TypeError naming it.
What is declared with `Internal` is what would fail silently, or far from its cause, when
megatron-core changes: functions and classes patched or replaced, private names read or set,
globals injected, config fields assigned, and functions called positionally. `verify()`
resolves each target in the installed megatron-core and compares it with what was checked;
anything moved or changed stops the run with one message naming every such target and its
user.

The modules that patch go through the declarations (`Internal.swapped`, `replace_fallback`,
`backward_step`), so a declaration and its use cannot drift apart.
docs/compatibility.md lists what changed between the releases in CHECKED_ON and how each
change is handled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging

log = logging.getLogger(__name__)

# megatron-core releases every declaration was checked on (setup.py allows >=0.16.1,<0.20)
CHECKED_ON = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")

_MISSING = object()


class CoreInternalsError(RuntimeError):
    """The installed megatron-core lacks or changed internals the trainer relies on."""


@dataclasses.dataclass(frozen=True)
class Internal:
    """One megatron.core name the trainer relies on.

    `target` is "module:attribute.path". `positional`: the leading positional parameters
    the trainer passes, one tuple per megatron-core signature it supports (`variant()` says
    which is installed). `keywords`: parameters it passes by name. `read_by`: text that
    megatron.core's source (of `read_in`, default the target's class or module) must still
    contain for the dependency to mean anything (a global it reads, a method it calls on
    itself). `fields`: dataclass fields the trainer assigns on instances (assigning a
    removed field would silently do nothing). `value`: the value the trainer assumes.
    `fallback`: what megatron-core installs at `target` without apex and Transformer
    Engine (see `replace_fallback`). `stand_in`: a class member of ours that megatron-core
    calls in place of `target` and must take the same parameters."""

    target: str
    how: str  # patched | replaced | private | injected | called | assigned | stand-in
    user: str  # project file and function
    positional: tuple[tuple[str, ...], ...] = ()
    keywords: tuple[str, ...] = ()
    read_by: tuple[str, ...] = ()
    read_in: str | None = None
    fields: tuple[str, ...] = ()
    value: object = _MISSING
    fallback: str | None = None
    stand_in: str | None = None

    def resolve(self):
        return _resolve(self.target)

    def problem(self) -> str | None:
        """Why the installed megatron-core does not satisfy this dependency, or None."""
        if self.how == "injected":  # absent until the trainer puts it there
            return self._unused_reads()
        for name in targets(self):
            try:
                _resolve(name)
            except (ImportError, AttributeError) as error:
                return f"{name} is missing (moved or renamed: {error})"
        value = self.resolve()
        if self.positional or self.keywords:
            names, open_keywords = _parameters(value)
            if names is None:
                return f"{self.target} is no longer a function"
            if self.positional and self.variant_of(names) is None:
                wanted = " or ".join(f"({', '.join(p)})" for p in self.positional)
                return f"{self.target} takes ({', '.join(names)}); expected {wanted}"
            missing = [k for k in self.keywords if k not in names]
            if missing and not open_keywords:
                return f"{self.target} no longer takes {', '.join(missing)}"
        if self.fields:
            declared = {f.name for f in dataclasses.fields(value)}
            missing = [name for name in self.fields if name not in declared]
            if missing:
                return f"{self.target} no longer has the field(s) {', '.join(missing)}"
        if self.value is not _MISSING and value != self.value:
            return f"{self.target} is {value!r}; expected {self.value!r}"
        if self.stand_in is not None:
            ours, _ = _parameters(_resolve(self.stand_in))
            theirs, _ = _parameters(value)
            if ours != theirs:
                return (f"{self.target} takes ({', '.join(theirs or [])}) but its stand-in "
                        f"{self.stand_in} takes ({', '.join(ours or [])})")
        return self._unused_reads()

    def _unused_reads(self) -> str | None:
        if not self.read_by:
            return None
        try:
            source = _source(self)
        except (ImportError, AttributeError) as error:
            return f"{self.read_in} is missing (moved or renamed: {error})"
        unused = [text for text in self.read_by if text not in source]
        if not unused:
            return None
        where = self.read_in or self.target
        return f"{where}: megatron.core no longer uses {', '.join(unused)}"

    def variant_of(self, names: list[str]) -> int | None:
        for index, expected in enumerate(self.positional):
            if tuple(names[: len(expected)]) == expected:
                return index
        return None

    def variant(self) -> int | None:
        """Index into `positional` of the installed signature (None: not a declared one)."""
        return _variant(self, self.resolve())

    def owner_and_name(self):
        """The object holding the target and the target's attribute name."""
        module_name, _, path = self.target.partition(":")
        owner = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        return owner, name

    @contextlib.contextmanager
    def swapped(self, replacement):
        """`replacement` at the target while open (also where the target is absent: an
        injected global), the previous state restored afterwards."""
        owner, name = self.owner_and_name()
        original = vars(owner).get(name, _MISSING) if inspect.isclass(owner) else getattr(
            owner, name, _MISSING)
        setattr(owner, name, replacement)
        try:
            yield
        finally:
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


@functools.lru_cache(maxsize=8)
def _variant(internal: Internal, function) -> int | None:
    names, _ = _parameters(function)
    return None if names is None else internal.variant_of(names)


def _resolve(target: str):
    """The object named "module:attribute.path". An attribute of a class must be the class's
    own: one inherited from a base class is not what was checked (AttributeError)."""
    module_name, _, path = target.partition(":")
    value = importlib.import_module(module_name)
    for part in path.split("."):
        if inspect.isclass(value) and part not in vars(value):
            raise AttributeError(f"{value.__name__}.{part} is not defined by the class itself")
        value = getattr(value, part)
    return value


def _parameters(value) -> tuple[list[str] | None, bool]:
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return None, False
    fixed = [p.name for p in signature.parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    open_keywords = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    return fixed, open_keywords


def _source(internal: Internal) -> str:
    """Source of `read_in`, or of the target's class (or module) that must use `read_by`."""
    if internal.read_in is not None:
        owner = _resolve(internal.read_in)
    else:
        module_name, _, path = internal.target.partition(":")
        owner = importlib.import_module(module_name)
        head = path.split(".")[0]
        if len(path.split(".")) > 1 and inspect.isclass(getattr(owner, head, None)):
            owner = getattr(owner, head)
    return _getsource(owner)


@functools.cache
def _getsource(owner) -> str:
    """Reading and tokenizing megatron-core's files took about a second a start-up; a process
    that starts several runs (or forks its ranks from one that verified) reads them once."""
    try:
        return inspect.getsource(owner)
    except (OSError, TypeError):
        return ""


_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_LAYERS = "megatron.core.tensor_parallel.layers"
_WGRAD_KERNELS = ("fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32",
                  "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16")

# megatron/dpp/schedule.py runs megatron-core's own per-microbatch steps
FORWARD_STEP = Internal(
    f"{_SCHEDULES}:forward_step", "called", "dpp/schedule.py _Iteration._forward",
    positional=(("forward_step_func", "data_iterator", "model", "num_microbatches",
                 "input_tensor", "forward_data_store", "config"),),
    keywords=("cp_group_size", "collect_non_loss_data", "is_first_microbatch",
              "current_microbatch", "vp_stage", "is_last_stage"))
BACKWARD_STEP = Internal(
    f"{_SCHEDULES}:backward_step", "called",
    "dpp/schedule.py _Iteration._backward (through core_internals.backward_step)",
    positional=(("input_tensor", "output_tensor", "output_tensor_grad", "model_type",
                 "config"),  # <= 0.16
                ("input_tensor", "output_tensor", "output_tensor_grad", "config")))
DEALLOCATE_OUTPUT_TENSOR = Internal(
    f"{_SCHEDULES}:deallocate_output_tensor", "called", "dpp/schedule.py _Iteration._forward",
    positional=(("out", "deallocate_pipeline_outputs"),))
# dpp/weight_grad.py: the B/W split without pipelining swaps BACKWARD_STEP during the call
NO_PIPELINING_CALLS_BACKWARD_STEP = Internal(
    f"{_SCHEDULES}:forward_backward_no_pipelining", "patched",
    "dpp/weight_grad.py SplitBackwardNoPipelining (swaps the module's backward_step)",
    read_by=("backward_step(",), read_in=f"{_SCHEDULES}:forward_backward_no_pipelining")
GLOBAL_MEMORY_BUFFER = Internal(
    "megatron.core.utils:GlobalMemoryBuffer.__init__", "private",
    "dpp/weight_grad.py _owned (the shared gather buffers)", read_by=("self.buffer = {}",))
# weight_grad_accumulation.weight_grad_accumulation_fusion: apex's module stood in for
GRAD_ACCUM_FUSION_AVAILABLE = Internal(
    f"{_LAYERS}:_grad_accum_fusion_available", "private",
    "dpp/weight_grad_accumulation.py weight_grad_accumulation_fusion, dpp/weight_grad.py",
    read_by=_WGRAD_KERNELS)
WGRAD_KERNELS = Internal(
    f"{_LAYERS}:fused_weight_gradient_mlp_cuda", "injected",
    "dpp/weight_grad_accumulation.py weight_grad_accumulation_fusion, dpp/weight_grad.py "
    "weight_grads_deferred", read_by=_WGRAD_KERNELS)
DRAIN_EMBEDDING_WGRAD = Internal(
    "megatron.core.utils:drain_embedding_wgrad_compute", "private",
    "dpp/weight_grad_accumulation.py _importable_by_name (the module megatron-core's "
    "schedules' drain imports)",
    read_by=("import fused_weight_gradient_mlp_cuda",),
    read_in="megatron.core.utils:drain_embedding_wgrad_compute")
# --defer-embedding-wgrad-compute: dpp/output_weight_grad.py takes the output layer's
# buffered inputs and output gradients out by microbatch and runs their GEMMs itself;
# models.py gives the other column-parallel linears a config without the deferral
OUTPUT_LAYER_DEFERRAL = Internal(
    f"{_LAYERS}:ColumnParallelLinear.forward", "private",
    "dpp/output_weight_grad.py DeferredOutputWeightGrads, trainer/model/models.py "
    "_defer_only_in_output_layer",
    read_by=("if self.config.defer_embedding_wgrad_compute:",
             "self.embedding_activation_buffer.append(input_parallel)",
             "self.grad_output_buffer if self.config.defer_embedding_wgrad_compute else None"))
OUTPUT_LAYER_GRAD_BUFFER = Internal(
    f"{_LAYERS}:LinearWithGradAccumulationAndAsyncCommunication.backward", "private",
    "dpp/output_weight_grad.py DeferredOutputWeightGrads.after_backward",
    read_by=("grad_output_buffer.append(grad_output)",))
GPT_OUTPUT_LAYER_BUFFERS = Internal(
    "megatron.core.models.gpt.gpt_model:GPTModel.__init__", "private",
    "dpp/output_weight_grad.py DeferredOutputWeightGrads",
    read_by=("self.embedding_activation_buffer = []", "self.grad_output_buffer = []"))
# dpp/tracing.py MegatronTimers reads the schedules' timer names
SCHEDULE_TIMER_NAMES = Internal(
    f"{_SCHEDULES}:get_forward_backward_func", "called",
    "dpp/tracing.py MegatronTimers (the schedules' timer names)",
    read_by=("'forward-compute'", "'backward-compute'"))
P2P_TIMER_NAMES = Internal(
    "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator", "called",
    "dpp/tracing.py MegatronTimers (the p2p timer names)", read_by=("-send'", "-recv'"))


INTERNALS = tuple(value for value in dict(globals()).values() if isinstance(value, Internal))


@dataclasses.dataclass(frozen=True)
class Feature:
    """A megatron-core behaviour the trainer uses where the installed release has it and does
    without otherwise: not checked by verify(), asked by `present()`."""

    internal: Internal

    def present(self) -> bool:
        return _present(self.internal)


@functools.cache
def _present(internal: Internal) -> bool:
    return internal.problem() is None



def verify(internals: tuple[Internal, ...] = INTERNALS) -> None:
    """Raise CoreInternalsError naming every unmet dependency (the first step of start-up)."""
    problems = [(internal, internal.problem()) for internal in internals]
    problems = [(internal, why) for internal, why in problems if why is not None]
    version = installed_version()
    if problems:
        lines = [f"{why} -- needed by megatron/{internal.user} ({internal.how})"
                 for internal, why in problems]
        raise CoreInternalsError(
            f"megatron-core {version} changed internals this trainer relies on (checked on "
            f"{', '.join(CHECKED_ON)}):\n  " + "\n  ".join(lines))
    if version not in CHECKED_ON:
        log.warning("megatron-core %s: not one of the releases the trainer was checked on "
                    "(%s); every internal it relies on is present", version, ", ".join(CHECKED_ON))


def installed_version() -> str:
    try:
        from megatron.core import package_info
    except ImportError:
        return "(unknown version)"
    return package_info.__version__


def targets(internal: Internal) -> tuple[str, ...]:
    """The megatron.core names a declaration depends on (its target and fallback)."""
    return tuple(t for t in (internal.target, internal.fallback) if t is not None)


def _kernel_origin(value) -> str | None:
    """'apex' or 'Transformer Engine' for the compiled kernels megatron-core imports when it
    finds them (their module names), None for anything else."""
    module = getattr(value, "__module__", None) or ""
    if module.startswith("transformer_engine"):
        return "Transformer Engine"
    if module.startswith(("amp_C", "apex")):
        return "apex"
    return None


@contextlib.contextmanager
def replace_fallback(internal: Internal, replacement):
    """`replacement` at `internal.target` while open, where megatron-core installed its
    no-apex fallback there; apex's or Transformer Engine's kernel, when that is what it
    found, stays. Anything else there stops the run. Yields what is in effect, in words."""
    current = internal.resolve()
    if current is replacement:  # entered again inside itself: already in place
        yield f"{_name(replacement)} (ours)"
        return
    if current is _resolve(internal.fallback):
        with internal.swapped(replacement):
            yield f"{_name(replacement)} (ours, for {_name(current)})"
        return
    origin = _kernel_origin(current)
    if origin is None:
        raise CoreInternalsError(
            f"{internal.target} is {_name(current)}: neither megatron-core's fallback "
            f"{internal.fallback} nor an apex / Transformer Engine kernel -- needed by "
            f"megatron/{internal.user}")
    yield f"{origin}'s {_name(current)}"


def _name(value) -> str:
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', value)}"


def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
    """megatron-core's schedules.backward_step under every supported release (0.16 also
    takes the model type, dropped in 0.17)."""
    from megatron.core.pipeline_parallel import schedules

    function = schedules.backward_step
    if _variant(BACKWARD_STEP, function) == 0:
        from megatron.core.enums import ModelType

        return function(input_tensor, output_tensor, output_tensor_grad,
                        ModelType.encoder_or_decoder, config)
    return function(input_tensor, output_tensor, output_tensor_grad, config)
