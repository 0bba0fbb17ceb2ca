"""The model versions an engine runs, and which one each request goes to.

A `ModelVersion` is one entry of the models file brought to life: its devices, its batch-time
estimate (flat, or learned from padded length), its watchdog budget and its batching policy.
The `Registry` routes a request by its `model` and `version` fields: a pinned version, or a
weighted choice among the name's ready versions that is stable for a given request id (a
retried request lands on the version it tried first). It also checks a request's `params`
against what the version's batch function accepts and turns them into the canonical form
that, with the version, makes the request's compatibility key: two requests share a batch
call only if they agree on all three.
"""

from __future__ import annotations

import enum
import inspect
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, NamedTuple, Protocol, TypeVar

import orjson

from ..config import Config
from ..errors import InvalidInput, ModelNotFound, NotReady, StartupError
from ..rules.capacity import BatchBudget, CallTime, DecayedRate, LengthCost
from ..rules.policy import Policy, make_policy
from ..rules.sharing import Senders
from .backends import device_factory
from .device_names import parse_devices
from .retrieval import TextModel, text_model_of
from .specs import DEFAULT_MODEL, MAX_NAME, BatchFn, DeviceFactory, ModelSpec

LOADING_RETRY_AFTER_S = 1.0
"""What a request for a version still loading is told to wait before it asks again."""


class VersionState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    """It takes no new requests; those it holds finish, then it unloads."""


@dataclass(eq=False)
class ModelVersion:
    spec: ModelSpec
    device_names: list[str]
    factory: DeviceFactory
    estimate: CallTime
    budget: BatchBudget
    policy: Policy
    state: VersionState = VersionState.LOADING
    param_names: frozenset[str] | None = frozenset()
    """Keyword arguments its batch function takes; None: any (it has **kwargs)."""
    count_tokens: Callable[[str], int] | None = None
    """The model's own tokenizer count, when its batch function exposes one."""
    embedding_dim: int | None = None
    """Set when its batch function says it returns vectors of this length."""
    text: TextModel | None = None
    """Its tokenizer, longest input and labels, when its batch function exposes them (the
    retrieval doors serve it then: retrieval.py)."""
    loaded_on: list[str] = field(default_factory=list)
    """The devices its batch function loaded on."""
    arrivals: DecayedRate = field(default_factory=DecayedRate)
    """Its requests a second, recent: the batcher counts them, and versions that share
    devices split the devices' time in proportion."""
    device_time: DecayedRate = field(default_factory=DecayedRate)
    """Seconds of device time its calls take a second, recent: what its neighbours on
    shared devices cannot count on."""
    senders: Senders = field(default_factory=Senders)
    """Which tenants sent to it lately: while more than one does, the batcher cuts its
    batches short (rules/sharing.py)."""
    plain_key: Key = field(init=False)
    """The key of its requests without params (flat cost): built once, not per request."""

    def __post_init__(self) -> None:
        self.plain_key = Key(self)

    def __repr__(self) -> str:
        return f"<ModelVersion {self.spec.label} {self.state.value}>"

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def version(self) -> str:
        return self.spec.version

    def learn(self, fn: BatchFn) -> None:
        """Reads what a loaded batch function accepts: keyword params, a token counter."""
        self.param_names = _keyword_names(fn)
        counter = getattr(fn, "count_tokens", None)
        self.count_tokens = counter if callable(counter) else None
        dim = getattr(fn, "embedding_dim", None)
        self.embedding_dim = dim if isinstance(dim, int) and not isinstance(dim, bool) else None
        self.text = text_model_of(fn)

    def call_budget_s(self, padded_tokens: int) -> float:
        """How long a call over `padded_tokens` may run before its device counts as hung."""
        return self.budget.seconds(self.estimate.predict(padded_tokens))

    def tokens(self, text: str) -> int:
        """An input's length: the model's tokens, else its characters."""
        return self.count_tokens(text) if self.count_tokens else len(text)

    def params_key(self, params: Mapping[str, Any] | None) -> bytes:
        """The canonical form of `params` (b"" for none): part of the compatibility key."""
        if not params:
            return b""
        if not isinstance(params, Mapping):
            raise InvalidInput(f"params must be a JSON object, not {type(params).__name__}")
        if self.param_names is not None:
            if not self.param_names:
                raise InvalidInput(f"model {self.spec.label} takes no params")
            unknown = sorted(params.keys() - self.param_names)
            if unknown:
                raise InvalidInput(
                    f"model {self.spec.label} takes no param {unknown[0][:MAX_NAME]!r};"
                    f" it takes {', '.join(sorted(self.param_names))}"
                )
        try:
            return orjson.dumps(params, option=orjson.OPT_SORT_KEYS)
        except TypeError as exc:
            raise InvalidInput(f"params cannot be passed on: {exc}") from None

    def describe(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "state": self.state.value,
            "kind": "batch",
            "weight": self.spec.weight,
            "devices": self.loaded_on or self.device_names,
            "cost": self.spec.cost,
            "max_batch_size": self.spec.max_batch_size,
        }


@dataclass(frozen=True, slots=True)
class Key:
    """A request's compatibility key: only requests with equal keys share a batch call.

    The model version, the canonical form of the request's params and, for length-cost
    models, its length bucket (so that short inputs do not pay for long ones)."""

    version: ModelVersion
    params_key: bytes = b""
    bucket: int = 0
    params: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)
    """The params themselves, passed to the batch function as keyword arguments."""
    poison: bytes = b""
    """A remembered poison input's digest: it runs apart, in batches of its own repeats
    only, so it fails only itself."""
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Hashed once: a key is looked up at every arrival and every release.
        hashed = hash((self.version, self.params_key, self.bucket, self.poison))
        object.__setattr__(self, "_hash", hashed)

    def __hash__(self) -> int:
        return self._hash


def build_version(
    config: Config,
    spec: ModelSpec,
    *,
    fn: BatchFn | None = None,
    fn_per_device: DeviceFactory | None = None,
    policy: Policy | None = None,
) -> ModelVersion:
    """A model version ready to load: its devices, estimate, watchdog budget and policy.
    `fn` / `fn_per_device` (Python objects) come before the spec's own."""
    try:
        names = parse_devices(spec.devices)
    except StartupError as exc:
        if spec.name == DEFAULT_MODEL:
            raise
        raise StartupError(f"model {spec.label}: {exc}") from None
    estimate = LengthCost() if spec.cost == "length" else CallTime()
    return ModelVersion(
        spec,
        names,
        device_factory(config, spec, names, fn=fn, fn_per_device=fn_per_device),
        estimate,
        BatchBudget(fixed_s=config.batch_timeout_ms / 1e3 or None),
        policy or make_policy(config.policy, spec, config.max_linger_ms, estimate),
    )


def _keyword_names(fn: BatchFn) -> frozenset[str] | None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return frozenset()  # a builtin that does not say: assume it takes the inputs only
    names: set[str] = set()
    positional = 0
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.VAR_KEYWORD:
            return None
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.VAR_POSITIONAL):
            continue
        if parameter.kind is parameter.POSITIONAL_OR_KEYWORD and positional == 0:
            positional += 1  # the inputs
            continue
        names.add(parameter.name)
    return frozenset(names)


class Routable(Protocol):
    """What routing reads of a version: a batch model's or a generation model's."""

    spec: ModelSpec
    state: VersionState

    def describe(self) -> dict[str, Any]: ...


Version = TypeVar("Version", bound=Routable)


class Wording(NamedTuple):
    """How a table's refusals name its models."""

    noun: str
    """"model", "generation model": `no model 'x'`."""
    verb: str
    """"runs", "generates with": `this server runs a, b`."""
    none: str
    """What it runs when it runs nothing: "no batch model"."""
    when_empty: str | None = None
    """The refusal of a request that names no model when there is none (None: as when
    there are several)."""


class Routes(Generic[Version]):
    """Versions by model name, and the one place a request is routed to one of them: a
    pinned version, or a weighted choice among the name's ready versions that is stable
    for a given request id. The batch models' `Registry` and the generation models'
    `Generators` are each one of these."""

    def __init__(self, versions: list[Version], wording: Wording) -> None:
        self._wording = wording
        self._by_name: dict[str, dict[str, Version]] = {}
        self._sole: Version | None = None
        """The one version, while there is only one: a request naming nothing routes to it
        without a look at names and weights."""
        for version in versions:
            self.add(version)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {', '.join(v.spec.label for v in self)}>"

    def __iter__(self) -> Iterator[Version]:
        return iter([v for versions in self._by_name.values() for v in versions.values()])

    def get(self, name: str, version: str) -> Version | None:
        return self._by_name.get(name, {}).get(version)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def names(self) -> list[str]:
        return sorted(self._by_name)

    def add(self, version: Version) -> None:
        self._by_name.setdefault(version.spec.name, {})[version.spec.version] = version
        self._sole = self._only_version()

    def remove(self, version: Version) -> None:
        versions = self._by_name[version.spec.name]
        del versions[version.spec.version]
        if not versions:
            del self._by_name[version.spec.name]
        self._sole = self._only_version()

    def _only_version(self) -> Version | None:
        everything = list(self)
        return everything[0] if len(everything) == 1 else None

    def route(self, model: str | None, version: str | None, request_id: str) -> Version:
        """The version a request runs on; refusals say why (400, 404 or 503)."""
        sole = self._sole
        if (
            model is None
            and version is None
            and sole is not None
            and sole.state is VersionState.READY
        ):
            return sole
        versions = self._versions_of(model)
        if version is not None:
            chosen = versions.get(version)
            if chosen is None or chosen.state is VersionState.DRAINING:
                name = next(iter(versions.values())).spec.name
                raise ModelNotFound(
                    f"model {name} has no version {version[:MAX_NAME]!r};"
                    f" it has {', '.join(self._serving(versions))}"
                )
            if chosen.state is VersionState.LOADING:
                raise NotReady(
                    f"{chosen.spec.label} is still loading", retry_after_s=LOADING_RETRY_AFTER_S
                )
            return chosen
        ready = [v for v in versions.values() if v.state is VersionState.READY]
        if not ready:
            raise NotReady(
                f"no version of {next(iter(versions.values())).spec.name} is ready yet",
                retry_after_s=LOADING_RETRY_AFTER_S,
            )
        if len(ready) == 1:
            return ready[0]
        return weighted_pick(ready, [v.spec.weight for v in ready], request_id)

    def _versions_of(self, model: str | None) -> dict[str, Version]:
        if model is None:
            if len(self._by_name) == 1:
                return next(iter(self._by_name.values()))
            if not self._by_name and self._wording.when_empty is not None:
                raise InvalidInput(self._wording.when_empty)
            raise InvalidInput(f'name a "model": {self._runs()}')
        versions = self._by_name.get(model)
        if versions is None:
            raise ModelNotFound(
                f"no {self._wording.noun} {model[:MAX_NAME]!r}; {self._runs()} (GET /api/models)"
            )
        return versions

    def _runs(self) -> str:
        """What the server runs, for a refusal: "this server runs a, b"."""
        return f"this server {self._wording.verb} {', '.join(self.names) or self._wording.none}"

    @staticmethod
    def _serving(versions: dict[str, Version]) -> list[str]:
        return sorted(
            v.spec.version for v in versions.values() if v.state is not VersionState.DRAINING
        )

    def describe(self) -> list[dict[str, Any]]:
        """GET /api/models: each model, its versions, their devices, weights and state."""
        return [
            {"name": name, "versions": [v.describe() for v in versions.values()]}
            for name, versions in sorted(self._by_name.items())
        ]


TextKind = Literal["embed", "rerank", "predict", "any"]
_NOT_OF_KIND = {
    "embed": "is not an embedder with a tokenizer: it cannot serve /embed",
    "rerank": "is not a one-label classifier (a reranker): it cannot serve /rerank",
    "predict": "is not a classifier: it cannot serve /predict",
    "any": "exposes no tokenizer and max_input_tokens: it cannot serve the retrieval routes",
}

BATCH_WORDING = Wording(
    "model",
    "runs",
    "no batch model",
    when_empty="this server runs no batch model; its models generate text:"
    " POST /api/generate or /v1/completions",
)


class Registry(Routes[ModelVersion]):
    """Every batch model version by name, and the routing of requests to them."""

    def __init__(self, versions: list[ModelVersion]) -> None:
        super().__init__(versions, BATCH_WORDING)

    def embedding_dim(self, model: str) -> int:
        """The vector length `model` returns; 400 if any of its versions returns no vectors."""
        dims = {v.embedding_dim for v in self._versions_of(model).values()}
        dim = dims.pop()
        if dim is None or dims:
            raise InvalidInput(f"model {model} does not return embedding vectors")
        return dim

    def dimensions(self, model: str) -> frozenset[int]:
        """The vector lengths a request may ask of `model`: its width, and the Matryoshka
        sizes under it that every one of its versions declares."""
        dim = self.embedding_dim(model)
        versions = self._versions_of(model).values()
        declared = frozenset.intersection(*(frozenset(v.spec.dimensions) for v in versions))
        return frozenset(size for size in declared if size < dim) | {dim}

    def text_model(self, model: str | None, kind: TextKind) -> tuple[str, TextModel]:
        """The name and the facts of the model a retrieval request names, or, unnamed, of
        the one model of `kind`; 400 if it is not of that kind (or exposes no tokenizer:
        retrieval.py), 503 while it loads."""
        if model is None:
            fitting = [name for name in self.names if self._text_of(name, kind) is not None]
            if len(fitting) != 1 and not (len(self.names) == 1 and not fitting):
                raise InvalidInput(
                    f'name a "model": this server runs {len(fitting)} of this route\'s kind'
                    f" ({', '.join(fitting) or 'none'})"
                )
            model = (fitting or self.names)[0]
        versions = self._versions_of(model)
        name = next(iter(versions.values())).spec.name
        facts = self._text_of(name, kind)
        if facts is not None:
            return name, facts
        if any(v.state is VersionState.LOADING for v in versions.values()):
            raise NotReady(f"{name} is still loading", retry_after_s=LOADING_RETRY_AFTER_S)
        raise InvalidInput(f"model {name} {_NOT_OF_KIND[kind]} (docs/models.md, Retrieval)")

    def _text_of(self, name: str, kind: TextKind) -> TextModel | None:
        for version in self._by_name[name].values():
            facts = version.text
            if facts is not None and (
                kind == "any"
                or (kind == "embed" and facts.labels is None and version.embedding_dim)
                or (kind == "predict" and facts.labels is not None)
                or (kind == "rerank" and facts.labels is not None and len(facts.labels) == 1)
            ):
                return facts
        return None


Choice = TypeVar("Choice")


def weighted_pick(choices: list[Choice], weights: list[float | None], request_id: str) -> Choice:
    """Versions share traffic by weight (1 without one); the same id picks the same one."""
    shares = [weight or 1.0 for weight in weights]
    point = zlib.crc32(request_id.encode()) / 2**32 * sum(shares)
    for choice, share in zip(choices, shares, strict=True):
        point -= share
        if point < 0:
            return choice
    return choices[-1]
