"""The run's configuration: small nested frozen dataclasses, every field bindable by gin.

Each config class is registered with gin under its own name, so a gin file says
`OptimizerConfig.learning_rate = 3e-4` or `RolloutSpec.group_size = 8`. A class's nested
configs that are not bound explicitly are built through gin too, inside a scope named after
the field, so bindings reach every level and two fields of one type can be told apart:
`trainer_mesh/MeshConfig.fsdp = 4` vs `rollout_mesh/MeshConfig.tensor = 2`.

A class built in several places (MeshConfig, AdvantageConfig) takes only scoped bindings:
an unscoped `AdvantageConfig.name = ...` would reach every place at once, so it is an error
that names the places and their scopes.

gin rejects unknown configurables and parameter names when the file is parsed; each class
validates its values when built; `build_experiment` builds the whole tree at once, so every
mistake surfaces before any work starts.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import os
import tokenize
import types
import typing
from typing import Any, Callable, Mapping, Optional

import gin

from jaxrl_post import plugins
from jaxrl_post.checkpoint import CheckpointConfig
from jaxrl_post.data.prompts import PromptConfig
from jaxrl_post.errors import UserError
from jaxrl_post.envs import EpisodeLimits, GuessingGame, HumanEvalFeedback, ToolArithmetic
from jaxrl_post.models import LoraConfig, MoeConfig
from jaxrl_post.rewards import (ArithmeticTask, ComposedTask, CountdownTask, FormatReward,
                                HumanEvalTask, JsonlTask, LengthPenalty, default_workers)
from jaxrl_post.pipeline.dynamic import DynamicSamplingSpec
from jaxrl_post.rl.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig
from jaxrl_post.rl.dapo import OverlongConfig
from jaxrl_post.rl.losses import LossConfig
from jaxrl_post.rl.off_policy import OffPolicyConfig
from jaxrl_post.rl.optim import OptimizerConfig
from jaxrl_post.rl.routing import RoutingReplay
from jaxrl_post.rl.sft import SftConfig
from jaxrl_post.rl.trainer import TrainerConfig
from jaxrl_post.rollout.engine import EngineConfig
from jaxrl_post.rollout.pages import PoolConfig
from jaxrl_post.rollout.scheduler import SchedulerConfig
from jaxrl_post.sharding import MeshConfig, PlacementConfig, SyncConfig
from jaxrl_post.telemetry.alarms import AlarmSpec
from jaxrl_post.telemetry.profile import ProfileSpec
from jaxrl_post.telemetry.trackers import MlflowSpec, WandbSpec


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Which policy to train.

  Attributes:
    source: a preset name (random weights: for tests and the quickstart), an embedded model
      name, a GGUF file, a Hugging Face model directory or hub id ("Qwen/Qwen3-0.6B",
      through the hub's cache: models.hub).
    tokenizer: "chars" (one id per character; presets need it) or "" for the model's own.
    init_seed: seed of random weights and LoRA adapters.
    overrides: ModelConfig fields to change, e.g. {"compute_dtype": "float32"}.
    lora: train LoRA adapters instead of the full model.
    moe: experts in place of a preset's dense MLP (random weights; a checkpoint's own
      experts come from its config.json).
  """

  source: str = "tiny"
  tokenizer: str = ""
  init_seed: int = 0
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  lora: Optional[LoraConfig] = None
  moe: Optional[MoeConfig] = None

  def __post_init__(self):
    if self.tokenizer not in ("", "chars"):
      raise UserError(f"model spec: tokenizer={self.tokenizer!r} is not '' or 'chars'")


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
  """Attributes:
    prompts_per_step: prompts drawn per RL step.
    group_size: K, samples per prompt (GRPO's group).
    max_new_tokens: completion budget.
    temperature, top_k, top_p: sampling (the trainer uses the same temperature).
    engine: decode slots, pool and shapes; num_slots None decodes a whole step at once
      (prompts_per_step x group_size slots).
    scheduler: prefill/decode interleaving.
  """

  prompts_per_step: int = 8
  group_size: int = 8
  max_new_tokens: int = 64
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
  scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)

  def __post_init__(self):
    for name in ("prompts_per_step", "group_size", "max_new_tokens"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise UserError(f"rollout spec: {name} must be a positive integer, "
                        f"got {getattr(self, name)!r}")
    if self.temperature <= 0:
      raise UserError(f"rollout spec: temperature must be > 0, got {self.temperature}")
    # Resolved here, not in the loop, so every reader of the spec (the loop, evaluation,
    # the planner) sees the same concrete slot count.
    sized = self.engine.sized_for(self.prompts_per_step * self.group_size)
    object.__setattr__(self, "engine", sized)


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """The verifier pool, which scores each prompt's samples while the engine decodes the rest.

  Attributes:
    workers: verifier calls at once (default: min(4, this process's CPUs)).
    timeout_s: longest one call may run; past it the call scores 0 and its worker is
      replaced.
    processes: verify in worker processes, so a hung or crashing verifier is killed; False
      verifies on threads of the trainer (for a task that cannot be pickled), where a hung
      call can only be abandoned.
  """

  workers: int = dataclasses.field(default_factory=default_workers)
  timeout_s: float = 10.0
  processes: bool = True

  def __post_init__(self):
    if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 1:
      raise UserError(f"reward spec: workers must be a positive integer, got {self.workers!r}")
    if not isinstance(self.timeout_s, (int, float)) or not 0 < self.timeout_s < float("inf"):
      raise UserError(f"reward spec: timeout_s must be a finite number > 0, "
                      f"got {self.timeout_s!r}")
    if not isinstance(self.processes, bool):
      raise UserError(f"reward spec: processes must be True or False, got {self.processes!r}")


@dataclasses.dataclass(frozen=True)
class EvalSpec:
  """Held-out evaluation. every_n_steps=0 evaluates only at the start and the end.

  Attributes:
    every_n_steps, num_problems: when, and on how many of the eval split's problems.
    samples: 0 for greedy pass@1 alone; n > 0 also draws n samples per problem at
      `temperature` and reports pass@k (unbiased, from the n) and maj@k (majority answer
      of the first k) for k = 1, 2, 4, ... n.
  """

  every_n_steps: int = 10
  num_problems: int = 200
  samples: int = 0
  temperature: float = 1.0

  def __post_init__(self):
    if self.every_n_steps < 0 or self.num_problems < 1:
      raise UserError(f"eval spec: need every_n_steps >= 0 and num_problems >= 1, got "
                      f"{self.every_n_steps} and {self.num_problems}")
    if not isinstance(self.samples, int) or self.samples < 0:
      raise UserError(f"eval spec: samples={self.samples!r} must be an integer >= 0")
    if not self.temperature > 0:
      raise UserError(f"eval spec: temperature={self.temperature!r} must be > 0")


@dataclasses.dataclass(frozen=True)
class LogSpec:
  """Attributes:
    tensorboard: also write TensorBoard event files into the workdir.
    progress: draw the progress bar.
    wandb: also log to Weights & Biases (`LogSpec.wandb = @WandbSpec()`); None: off.
    mlflow: also log to MLflow (`LogSpec.mlflow = @MlflowSpec()`); None: off.
  """

  tensorboard: bool = True
  progress: bool = True
  wandb: Optional[WandbSpec] = None
  mlflow: Optional[MlflowSpec] = None


@dataclasses.dataclass(frozen=True)
class ReferenceSpec:
  """The frozen reference policy (KL penalty and metrics).

  Attributes:
    dtype: "float32" keeps the initial weights exactly; "bfloat16" halves their memory
      (2 bytes per parameter), which the forward computes in anyway with a bf16 model.
  """

  dtype: str = "float32"

  def __post_init__(self):
    if self.dtype not in ("float32", "bfloat16"):
      raise UserError(f"reference spec: dtype={self.dtype!r} is not 'float32' or 'bfloat16'")


ASYNC_MODES = ("sync", "one_step_off", "bounded")
WEIGHT_UPDATES = ("between_batches", "in_flight")


@dataclasses.dataclass(frozen=True)
class AgentSpec:
  """Multi-turn episodes, for a task that is an environment (jaxrl_post.envs).

  RolloutSpec.max_new_tokens is then the most tokens of one model turn.

  Attributes:
    max_turns: model turns per episode (the environment's own max_turns also holds).
    max_tokens: tokens after the prompt per episode, the model's and the observations';
      the trainer's completions are this long at most.
    reward: an episode's reward: the "sum" of its turns' rewards or the "last" one's.
    credit: "episode": every token gets its episode's group advantage; "reward_to_go":
      each turn's tokens get the advantage of the rewards from that turn on (with
      reward "sum"; rl.turn_credit).
    env_workers: worker processes that step environments (killed and replaced past the
      deadline or when they die).
    step_timeout_s: longest one environment step may take (see envs.EpisodeLimits);
      failed steps are counted as env/errors, env/timeouts, env/crashes.
    store: write every episode to WORKDIR/trajectories.jsonl.
  """

  max_turns: int = 4
  max_tokens: int = 256
  reward: str = "sum"
  credit: str = "episode"
  env_workers: int = 8
  step_timeout_s: float = 60.0
  store: bool = True

  def __post_init__(self):
    self.limits()  # Validates.
    if self.credit not in ("episode", "reward_to_go"):
      raise UserError(f"agent spec: credit must be 'episode' or 'reward_to_go', "
                      f"got {self.credit!r}")
    if self.credit == "reward_to_go" and self.reward != "sum":
      raise UserError("agent spec: credit='reward_to_go' credits the rewards of later turns, "
                      f"which needs reward='sum', not {self.reward!r}")
    if not isinstance(self.env_workers, int) or self.env_workers < 1:
      raise UserError(f"agent spec: env_workers must be a positive integer, "
                      f"got {self.env_workers!r}")

  def limits(self) -> EpisodeLimits:
    return EpisodeLimits(self.max_turns, self.max_tokens, self.reward, self.step_timeout_s)


@dataclasses.dataclass(frozen=True)
class AsyncSpec:
  """How rollout and training overlap.

  Attributes:
    mode: "sync" (on-policy, the synchronous loop), "one_step_off" (each batch drawn with
      the weights one RL step older than the synchronous loop's, while the trainer trains
      on the previous batch) or "bounded" (batches drawn up to max_staleness optimizer
      steps ahead).
    max_staleness: "bounded": the most optimizer steps between the weights that drew a
      token and the old policy it is trained against (the batch's first optimizer step;
      the later minibatches' own steps are PPO's usual, bounded by the clipped ratio);
      lag = max_staleness // TrainerConfig.minibatches RL steps, at least 1.
    weight_updates: "between_batches" (a batch's sequences all finish on the weights they
      started with; the run samples the same tokens however fast each side is) or
      "in_flight" (a newer version enters the engine between two decode calls of the batch
      being drawn: running sequences keep their K/V and go on with the new weights, their
      later tokens stamped with its version; fresher tokens, timing-dependent samples).
  """

  mode: str = "sync"
  max_staleness: int = 2
  weight_updates: str = "between_batches"

  def __post_init__(self):
    if self.mode not in ASYNC_MODES:
      raise UserError(f"async spec: mode={self.mode!r} is not one of {ASYNC_MODES}")
    if self.weight_updates not in WEIGHT_UPDATES:
      raise UserError(f"async spec: weight_updates={self.weight_updates!r} is not one of "
                      f"{WEIGHT_UPDATES}")
    if not isinstance(self.max_staleness, int) or self.max_staleness < 1:
      raise UserError(f"async spec: max_staleness must be a positive integer, got "
                      f"{self.max_staleness!r}")

  def lag(self, minibatches: int) -> int:
    """RL steps between the weights that draw a batch and the synchronous loop's."""
    if self.mode == "sync":
      return 0
    if self.mode == "one_step_off":
      return 1
    if self.max_staleness < minibatches:
      raise UserError(f"async spec: max_staleness={self.max_staleness} optimizer steps is "
                      f"less than one RL step ({minibatches} minibatches)")
    return self.max_staleness // minibatches


def _grpo() -> AdvantageConfig:
  """GRPO; its group_size is replaced by RolloutSpec.group_size in `validate`."""
  return AdvantageConfig("grpo", group_size=2)


@dataclasses.dataclass(frozen=True)
class Experiment:
  """One RL run. AdvantageConfig.group_size is always RolloutSpec.group_size.

  The algorithm is chosen by its parts: GRPO-family estimators under `advantage`; PPO with
  a critic is `advantage` "gae" with a value-head model (ModelSpec.overrides value_head);
  DAPO adds `dynamic_sampling`, `overlong` and LossConfig.clip_high to GRPO.
  """

  steps: int = 100
  seed: int = 0
  model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
  task: Any = dataclasses.field(default_factory=ArithmeticTask)
  prompts: PromptConfig = dataclasses.field(default_factory=PromptConfig)
  rollout: RolloutSpec = dataclasses.field(default_factory=RolloutSpec)
  reward: RewardSpec = dataclasses.field(default_factory=RewardSpec)
  advantage: AdvantageConfig = dataclasses.field(default_factory=_grpo)
  trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
  reference: ReferenceSpec = dataclasses.field(default_factory=ReferenceSpec)
  sft: SftConfig = dataclasses.field(default_factory=SftConfig)
  placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
  sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  eval: EvalSpec = dataclasses.field(default_factory=EvalSpec)
  logging: LogSpec = dataclasses.field(default_factory=LogSpec)
  dynamic_sampling: Optional[DynamicSamplingSpec] = None  # DAPO: refill constant groups.
  overlong: Optional[OverlongConfig] = None  # DAPO: soft overlong reward penalty.
  asynchronous: AsyncSpec = dataclasses.field(default_factory=AsyncSpec)
  agent: AgentSpec = dataclasses.field(default_factory=AgentSpec)  # Environment tasks.
  profile: ProfileSpec = dataclasses.field(default_factory=ProfileSpec)  # Trace, profiler.
  alarms: AlarmSpec = dataclasses.field(default_factory=AlarmSpec)

  def __post_init__(self):
    if not isinstance(self.steps, int) or self.steps < 1:
      raise UserError(f"experiment: steps must be a positive integer, got {self.steps!r}")


# --------------------------------------------------------------------------- gin registry

_NAMES: dict[type, str] = {}
CONFIGURABLES: dict[str, Callable[..., Any]] = {}


def _build(cls: type, default: Any = None, given: Optional[dict] = None) -> Any:
  """Builds `cls` from gin bindings (or `given`), over `default`'s field values.

  A nested field holding a registered config (by default or as `default`'s value) is built
  the same way inside a gin scope named after the field, so bindings reach it.
  """
  kwargs = dict(given) if given is not None else gin.get_bindings(_NAMES[cls])
  for name, value in kwargs.items():
    _check_type(cls, name, value)
  for field in dataclasses.fields(cls):
    if field.name in kwargs or not field.init:  # init=False: the class computes it
      continue
    if default is not None:
      value = getattr(default, field.name)
    elif field.default_factory is not dataclasses.MISSING:
      value = field.default_factory()
    elif field.default is not dataclasses.MISSING:
      value = field.default
    else:
      continue  # Required: the constructor names it if it stays unset.
    if type(value) in _NAMES:
      # The scope is the field name alone (not the path), so `trainer_mesh/MeshConfig.x`
      # works wherever a PlacementConfig is built.
      with gin.config_scope(None), gin.config_scope(field.name):
        value = _build(type(value), value)
    kwargs[field.name] = value
  return cls(**kwargs)


# What a bound value of a plain field type must be, as the error says it.
_PLAIN = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}


@functools.cache
def _plain_types(cls: type) -> dict[str, tuple[type, ...]]:
  """Field -> the plain types it takes (None included where Optional), for the fields whose
  annotation is int, float, str or bool, alone or Optional; a class whose annotations do
  not resolve (a user's) gets none checked."""
  try:
    hints = typing.get_type_hints(cls)
  except Exception:  # noqa: BLE001 (a user's forward reference: its constructor checks)
    return {}
  out = {}
  for name, hint in hints.items():
    args = (typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType)
            else (hint,))
    if all(a in _PLAIN or a is type(None) for a in args):
      out[name] = args
  return out


def _takes(kind: type, value: Any) -> bool:
  """Whether a field of plain type `kind` takes `value`: a bool is no number (True is an
  int to Python), an int is a float."""
  if kind is type(None):
    return value is None
  if kind is bool:
    return isinstance(value, bool)
  if isinstance(value, bool):
    return False
  return isinstance(value, (int, float) if kind is float else kind)


def _check_type(cls: type, name: str, value: Any) -> None:
  """A gin value of the wrong plain type (`num_slots = 'many'`) is one error naming the
  field, not a comparison failing inside the class's checks."""
  allowed = _plain_types(cls).get(name)
  if allowed is None or isinstance(value, gin.config.ConfigurableReference):
    return
  if not any(_takes(kind, value) for kind in allowed):
    what = " or ".join(_PLAIN[a] for a in allowed if a in _PLAIN)
    what += " or None" if type(None) in allowed else ""
    raise UserError(f"config: {cls.__name__}.{name} = {value!r} is not {what}")


def _register(cls: type) -> None:
  def make(**kwargs):
    return _build(cls, given=kwargs)

  make.__signature__ = inspect.signature(cls)
  make.__name__ = cls.__name__
  _NAMES[cls] = cls.__name__
  CONFIGURABLES[cls.__name__] = gin.external_configurable(make, name=cls.__name__)


for _cls in (ModelSpec, RolloutSpec, RewardSpec, EvalSpec, LogSpec, ReferenceSpec, Experiment,
             ArithmeticTask, CountdownTask, JsonlTask, PromptConfig, AdvantageConfig, LossConfig,
             OffPolicyConfig, OptimizerConfig, SftConfig, TrainerConfig, EngineConfig,
             PoolConfig, SchedulerConfig, MeshConfig, PlacementConfig, SyncConfig,
             CheckpointConfig, LoraConfig, HumanEvalTask, ComposedTask, FormatReward,
             LengthPenalty, MoeConfig, RoutingReplay, AsyncSpec):
  _register(_cls)
for _cls in (DynamicSamplingSpec, OverlongConfig):
  _register(_cls)
for _cls in (AgentSpec, GuessingGame, ToolArithmetic, HumanEvalFeedback):
  _register(_cls)
for _cls in (ProfileSpec, AlarmSpec, WandbSpec, MlflowSpec):
  _register(_cls)


def _register_plugin(cls: type) -> None:
  """A class of the user's (jaxrl_post.register): like a built-in, unless its name is taken.

  A class registered already (a built-in included) stays as it is: registering it twice
  names no other class, so it is no mistake.
  """
  name = cls.__name__
  if name in CONFIGURABLES:
    taken = next(c for c, n in _NAMES.items() if n == name)
    if taken is cls:
      return
    raise UserError(f"register: {cls.__module__}.{cls.__qualname__}: the name {name!r} is "
                    f"taken by {taken.__module__}.{taken.__qualname__}; rename the class")
  try:
    _register(cls)
  except ValueError as e:  # gin's own registry holds the name (a gin.configurable).
    raise UserError(f"register: {cls.__module__}.{cls.__qualname__}: {_first_lines(e)}") from e


plugins.attach(_register_plugin)


@gin.configurable
def data_file(directory: str = ".", name: str = "") -> str:
  """A path from a directory macro and a file name (`@train/data_file()` in gin files)."""
  return os.path.join(directory, name)


def parse(gin_files: list[str], bindings: list[str]) -> None:
  """Parses gin files and bindings; a mistake becomes one UserError line."""
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings(gin_files, bindings, finalize_config=False)
  except (ValueError, KeyError, SyntaxError, TypeError) as e:
    hint = (" (a class of your own? load its module with --gin_import=MODULE)"
            if "No configurable matching" in str(e) else "")
    raise UserError(f"gin: {_first_lines(e)}{hint}") from e
  except OSError as e:
    raise UserError(f"gin: cannot read config file: {e}") from e
  except tokenize.TokenError as e:  # An unclosed bracket or string: gin names no place.
    raise UserError(f"gin: {_untokenizable(gin_files, bindings)}: {e.args[0]}") from e


def _untokenizable(gin_files: list[str], bindings: list[str]) -> str:
  """Which file or binding Python's tokenizer stops on (gin reads each with it)."""
  texts = [(path, open(path).read()) for path in gin_files]
  texts += [(f"--gin_param='{b}'", b) for b in bindings]
  for where, text in texts:
    try:
      list(tokenize.generate_tokens(io.StringIO(text).readline))
    except tokenize.TokenError as e:
      return f"{where}, line {e.args[1][0]}" if where in gin_files else where
  return "a file it includes"


def places(root: Any = None, path: str = "Experiment") -> dict[str, list[str]]:
  """Where each config class is built in the experiment tree: class name -> field paths
  (the last part of each path is the gin scope that reaches it)."""
  root = Experiment() if root is None else root
  found: dict[str, list[str]] = {}
  for field in dataclasses.fields(root):
    value = getattr(root, field.name)
    if type(value) in _NAMES:
      found.setdefault(_NAMES[type(value)], []).append(f"{path}.{field.name}")
      for name, where in places(value, f"{path}.{field.name}").items():
        found.setdefault(name, []).extend(where)
  return found


def _check_unscoped_bindings() -> None:
  """An unscoped binding of a class built in several places is ambiguous: one UserError."""
  shared = {name: where for name, where in places().items() if len(where) > 1}
  for (scope, selector), params in gin.config._CONFIG.items():  # gin keeps no public view.
    name = selector.rsplit(".", 1)[-1]
    if scope or name not in shared or not params:
      continue
    param = sorted(params)[0]
    scoped = " or ".join(f"{w.rsplit('.', 1)[-1]}/{name}.{param}" for w in shared[name])
    raise UserError(f"gin: unscoped binding {name}.{param} is ambiguous: {name} is built at "
                    f"{' and '.join(shared[name])}; bind {scoped}")


def _references(value: Any):
  """The gin references (`@scope/Name()`) inside a bound value, lists and dicts included."""
  if isinstance(value, gin.config.ConfigurableReference):
    yield value
  elif isinstance(value, (list, tuple)):
    for item in value:
      yield from _references(item)
  elif isinstance(value, dict):
    for item in value.values():
      yield from _references(item)


def _check_scoped_bindings() -> None:
  """A scoped binding of a config class must name a scope one is built in: gin ignores
  `engin/EngineConfig.num_slots = 4` (a typo), and the run would go on without it. A
  class's scopes are the fields it is built at (places) and the scopes of references."""
  where = places()
  scopes = {name: {path.rsplit(".", 1)[-1] for path in paths} for name, paths in where.items()}
  for params in gin.config._CONFIG.values():  # gin keeps no public view.
    for value in params.values():
      for ref in _references(value):
        scopes.setdefault(ref.configurable.name, set()).add("/".join(ref.scopes))
  for (scope, selector), params in gin.config._CONFIG.items():
    name = selector.rsplit(".", 1)[-1]
    if not scope or not params or name not in CONFIGURABLES or scope in scopes.get(name, ()):
      continue
    built = (f"; {name} is built at {' and '.join(where[name])}" if name in where else
             f"; no reference @{scope}/{name}() uses it")
    raise UserError(f"gin: {scope}/{name}.{sorted(params)[0]} reaches nothing: no {name} is "
                    f"built in scope '{scope}'{built}")


def build_experiment() -> Experiment:
  """The whole config tree, built (and validated) through the gin bindings."""
  _check_unscoped_bindings()
  _check_scoped_bindings()
  try:
    exp = CONFIGURABLES["Experiment"]()
  except UserError as e:
    raise UserError(str(e).splitlines()[0]) from e
  except (TypeError, ValueError) as e:
    raise UserError(f"config: {_first_lines(e)}") from e
  return validate(exp)


def build(name: str) -> Any:
  """One registered config class (e.g. a command's own), built through the gin bindings."""
  _check_scoped_bindings()
  try:
    return CONFIGURABLES[name]()
  except UserError as e:
    raise UserError(str(e).splitlines()[0]) from e
  except (TypeError, ValueError) as e:
    raise UserError(f"config: {_first_lines(e)}") from e


def validate(exp: Experiment) -> Experiment:
  """Cross-field checks no single config can make."""
  k = exp.rollout.group_size
  adv = dataclasses.replace(exp.advantage, group_size=k)
  samples = exp.rollout.prompts_per_step * k
  split = exp.trainer.minibatches * exp.trainer.micro_batches
  if samples % split:
    raise UserError(f"config: prompts_per_step x group_size = {samples} samples do not split "
                    f"into TrainerConfig.minibatches x micro_batches = {split}")
  if exp.trainer.temperature != exp.rollout.temperature:
    raise UserError(f"config: TrainerConfig.temperature ({exp.trainer.temperature}) must equal "
                    f"RolloutSpec.temperature ({exp.rollout.temperature})")
  need = exp.prompts.max_prompt_tokens + exp.rollout.max_new_tokens
  if need > exp.trainer.row_tokens:
    raise UserError(f"config: max_prompt_tokens + max_new_tokens = {need} exceeds "
                    f"TrainerConfig.row_tokens = {exp.trainer.row_tokens}")
  _check_dapo(exp)
  return dataclasses.replace(exp, advantage=adv, trainer=_with_critic(exp, adv))


def _with_critic(exp: Experiment, adv: AdvantageConfig):
  """The trainer config, its GAE constants taken from Experiment.advantage for PPO.

  A value-head model trains with GAE inside the trainer's programs, and GAE needs the
  critic: each without the other would silently train something else.
  """
  critic = bool(dict(exp.model.overrides).get("value_head", False))
  per_token = ADVANTAGE_ESTIMATORS.get(adv.name).per_token
  if critic and not per_token:
    raise UserError(f"config: a value-head model (ModelSpec.overrides value_head) trains with "
                    f"GAE; set advantage/AdvantageConfig.name = 'gae', not {adv.name!r}")
  if per_token and not critic:
    raise UserError(f"config: advantage/AdvantageConfig.name = {adv.name!r} needs a critic; "
                    f"add 'value_head': True to ModelSpec.overrides")
  if not per_token:
    return exp.trainer
  if exp.trainer.gae != TrainerConfig().gae:
    raise UserError("config: set GAE's constants on advantage/AdvantageConfig "
                    "(Experiment.advantage), not gae/AdvantageConfig")
  return dataclasses.replace(exp.trainer, gae=adv)


def _check_dapo(exp: Experiment) -> None:
  if exp.dynamic_sampling is not None and exp.rollout.group_size < 2:
    raise UserError(f"config: Experiment.dynamic_sampling needs RolloutSpec.group_size >= 2, "
                    f"got {exp.rollout.group_size}")
  if exp.overlong is not None and exp.overlong.max_length > exp.rollout.max_new_tokens:
    raise UserError(f"config: OverlongConfig.max_length = {exp.overlong.max_length} exceeds "
                    f"RolloutSpec.max_new_tokens = {exp.rollout.max_new_tokens}")


def _first_lines(e: BaseException) -> str:
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return " | ".join(lines[:3])
