"""What the method builders of eval/bench/methods.py get: the run's loaded models and the engine each one runs on, built
once per model, backend and settings (the target, the draft model, the small models named in specs and the feature
drafters' own engines)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from draftsmith.config import ConfigError
from draftsmith.eval.decode.decoder import Method
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import WeightPrecision
from draftsmith.models.precision import DraftPrecision, with_precision
from draftsmith.models.student import every_nth_layer, layer_subset_student
from draftsmith.models.target import TargetModel
from draftsmith.models.vocab import DraftVocab, with_sliced_head


def require_invariant_kernels(what: str, option_text: str, backend: Backend, settings: CompileSettings) -> None:
    """An option only the compiled backend's batch-invariant kernels read is refused in one line elsewhere."""
    if not settings.runs_invariant_kernels(backend):
        raise ConfigError(f"{what}: {option_text} is read by the compiled backend's batch-invariant kernels only "
                          f"(backend={backend.value}, compile.kernels={settings.kernels.value}); drop it or use "
                          "backend=compiled with compile.kernels=invariant")


def draft_lm_storage(precision: DraftPrecision, backend: Backend, settings: CompileSettings,
                     weights: WeightPrecision | None = None,
                     what: str = "draft LM") -> tuple[DraftPrecision, CompileSettings]:
    """(the precision a draft LM's copy is converted to, the compile settings of its engine). Weight-only int8 on
    the batch-invariant kernels is their own int8 weights under a bf16 copy (a quarter of the fp32 weight stream,
    through the kernels every compiled step uses; a drafter reads its head's every logit, so the target's `head`
    is not its); elsewhere torch's weight-only int8 kernel. `weights` stores the weights of a float32 or bfloat16
    copy on those kernels (int8 under float32 activations: for a CPU without a bf16 dot product)."""
    if weights is not None:
        if precision not in (DraftPrecision.FLOAT32, DraftPrecision.BFLOAT16):
            raise ConfigError(f"{what}: weights={weights.value} and precision={precision.value} both set how the "
                              "draft LM's weights are stored; give weights= with precision=float32 or bfloat16")
        require_invariant_kernels(what, f"weights={weights.value}", backend, settings)
        return precision, replace(settings, weights=weights, head=None)
    if precision is DraftPrecision.INT8_WEIGHTS and settings.runs_invariant_kernels(backend):
        return DraftPrecision.BFLOAT16, replace(settings, weights=WeightPrecision.INT8, head=None)
    return precision, settings


@dataclass
class BuildContext:
    """The run's loaded models and the engine our methods run on (`backend`); extra models named in
    specs are loaded once per run, here, and every model gets one engine per backend."""

    target: TargetModel
    draft: TargetModel | None = None
    backend: Backend = Backend.EAGER
    settings: CompileSettings = field(default_factory=CompileSettings)
    greedy: bool = True  # the run decodes at temperature 0 (methods whose defaults differ under sampling read it)
    models: dict = field(default_factory=dict)
    engines: dict = field(default_factory=dict)  # (id(module), backend) -> TargetModel
    drafter_engines: list = field(default_factory=list)  # feature drafters' own engines (built with them)
    draft_read: bool = False  # a method drafts with the run's draft model
    draft_name: str | None = None  # the run's draft model by name (none passed in): loaded when first read

    @property
    def has_draft(self) -> bool:
        return self.draft is not None or self.draft_name is not None

    def check_draft_read(self) -> None:
        """After the methods are built: a draft model no method reads is refused (a user who named it believes it is
        in effect); one given by name only was never loaded."""
        if self.has_draft and not self.draft_read:
            name = self.draft.name if self.draft is not None else self.draft_name
            raise ConfigError(f"draft={name or 'the given draft model'}: no method reads it (lm-chain, "
                              "lm-parallel, lm-tree, hf-assisted, llmcad or minions without model=/every=); drop it "
                              "or add one")

    def engine(self, lm: TargetModel, backend: Backend | None = None,
               settings: CompileSettings | None = None) -> TargetModel:
        """`lm` driven by `backend` (default: the run's) and compile `settings` (default: the run's), built once
        per model, backend and settings."""
        backend, settings = backend or self.backend, settings or self.settings
        key = (id(lm.model), backend, repr(settings))
        if key not in self.engines:
            self.engines[key] = lm.with_backend(backend, settings)
        return self.engines[key]

    def target_for(self, method: Method) -> TargetModel:
        return self.engine(self.target, method.backend)

    def small_model(self, model: str | None, every: int | None, what: str, vocab: DraftVocab | None = None,
                    precision: DraftPrecision = DraftPrecision.FLOAT32,
                    shared_width: bool | None = None, weights: WeightPrecision | None = None) -> TargetModel:
        """The LM of an LM drafter under the run's backend: every N-th target layer, a named model, or the
        run's draft; with `vocab`, that model with its LM head sliced to the draft vocabulary; in `precision`
        (int8 runs eager whatever the run's backend; see draft_lm_storage for int8-weights and `weights`); compiled
        with the run's settings, or with `shared_width` in their place when given."""
        base = self._small_base(model, every, what)
        if vocab is not None:
            key = (id(base.model), vocab.digest())
            if key not in self.models:
                self.models[key] = TargetModel(with_sliced_head(base.model, vocab), base.tokenizer, name=base.name)
            base = self.models[key]
        backend = self.backend if precision.compiles else Backend.EAGER
        if shared_width is not None and backend is not Backend.COMPILED:
            raise ConfigError(f"{what}: shared_width is read by the compiled backend only, and this draft LM runs "
                              f"eager (backend={self.backend.value}, precision={precision.value}); drop it")
        settings = self.settings if shared_width is None else replace(self.settings, shared_width=shared_width)
        stored, settings = draft_lm_storage(precision, backend, settings, weights, what)
        if stored is not DraftPrecision.FLOAT32:
            key = (id(base.model), stored)
            if key not in self.models:
                self.models[key] = TargetModel(with_precision(base.model, stored), base.tokenizer, name=base.name)
            base = self.models[key]
        return self.engine(base, backend, settings)

    def _small_base(self, model: str | None, every: int | None, what: str) -> TargetModel:
        if every is not None and model is not None:
            raise ConfigError(f"{what}: give model= or every=, not both")
        if every is not None:
            key = ("every", every)
            if key not in self.models:
                layers = every_nth_layer(self.target.num_layers, every)
                self.models[key] = TargetModel(layer_subset_student(self.target.model, layers), self.target.tokenizer)
            return self.models[key]
        if model in (None, "draft"):
            if not self.has_draft:
                raise ConfigError(f"{what} needs the bench's draft model: set draft=<name> (or give the method "
                                  "model=<name> or every=<N>)")
            if self.draft is None:
                self.draft = TargetModel.from_pretrained(self.draft_name, dtype=self.target.dtype,
                                                         device=self.target.device)
            self.draft_read = True
            return self.draft
        if model not in self.models:
            self.models[model] = TargetModel.from_pretrained(model, dtype=self.target.dtype, device=self.target.device)
        return self.models[model]

    def vocab(self, path: str | None) -> DraftVocab | None:
        """A draft vocabulary, loaded once per run."""
        if path is None:
            return None
        if ("vocab", path) not in self.models:
            self.models[("vocab", path)] = DraftVocab.load(path)
        return self.models[("vocab", path)]

    def compiled_engines(self) -> list:
        """Every compiled engine of the run (targets, LM drafters, feature drafters), to build before timing."""
        engines = [lm.engine for lm in self.engines.values()] + self.drafter_engines
        return [engine for engine in engines if engine.name is Backend.COMPILED]
