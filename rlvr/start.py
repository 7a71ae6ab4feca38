"""Where a job's policy comes from, and what its workdir records so that later jobs need nothing else.

A job starts from exactly one of (docs/tutorials/bring-your-own-model.md):

  random init          `model.preset` and `model.*` (the default)
  init.hf_checkpoint   a Hugging Face directory: its config.json is the architecture, its tokenizer
                       files are the tokenizer
  init.workdir         an rlvr workdir's latest checkpoint, with the architecture, tokenizer, chat
                       template and system prompt it recorded (and, for RL and eval, its budgets)

RL may first warm-start on its tasks' demonstrations (`rl.sft_steps` > 0): from random init, or from
a checkpoint only when `rl.sft_on_checkpoint=True`, so a warm start never runs silently on top of a
user's model.

`resolve(config)` returns the config the job runs: `model.*` is the architecture it loads (every field
set), `tokenizer.path` the tokenizer directory, the system prompt and the RL budgets inherited or
derived (`rlvr.budgets`). A `model.*` or `tokenizer.*` value that contradicts the checkpoint is a
ConfigError naming every differing field and the fix. `record(config, workdir)` copies the tokenizer
(with the config's chat template) to WORKDIR/tokenizer/; with the resolved config.json that is all a
later job, `api.load_trained` and `rlvr.export` read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil

import ml_collections

from rlvr import config_lib
from rlvr.config_lib import ConfigError
from rlvr.data.chat import check_tool_calls
from rlvr.models.config import RUNTIME_FIELDS, LoraConfig, ModelConfig, VisionConfig
from rlvr.models.tokenizer import (
    BUILTIN_TEMPLATES,
    TOKENIZER_FILES,
    Tokenizer,
    byte_level_tokenizer,
    write_chat_template,
)

TOKENIZER_DIR = "tokenizer"  # inside a workdir


@dataclasses.dataclass(frozen=True)
class Source:
    """The starting point: kind "random", "hf" (a Hugging Face directory) or "workdir" (an rlvr run)."""

    kind: str
    path: str = ""

    def describe(self) -> str:
        return {"random": "random init", "hf": f"init.hf_checkpoint={self.path}",
                "workdir": f"init.workdir={self.path}"}[self.kind]


def source(config: ml_collections.ConfigDict) -> Source:
    init = config.init
    if init.hf_checkpoint and init.workdir:
        raise ConfigError(f"init.hf_checkpoint={init.hf_checkpoint!r} and init.workdir={init.workdir!r}: a job starts "
                          "from one checkpoint; clear one of them.")
    if init.hf_checkpoint:
        return Source("hf", os.path.expanduser(init.hf_checkpoint))
    if init.workdir:
        return Source("workdir", os.path.expanduser(init.workdir))
    return Source("random")


def init_overrides(path: str) -> dict[str, str]:
    """`{"init.hf_checkpoint": path}` or `{"init.workdir": path}`, whichever `path` is (for configs
    taking a directory as `:arg`)."""
    path = os.path.expanduser(path)
    if os.path.exists(os.path.join(path, "checkpoints")) and os.path.exists(os.path.join(path, "config.json")):
        return {"init.workdir": path}
    if os.path.exists(os.path.join(path, "config.json")):
        return {"init.hf_checkpoint": path}
    raise ConfigError(f"{path!r} is neither a Hugging Face directory (config.json + weights) nor an rlvr workdir "
                      "(config.json + checkpoints/); give the model's directory.")


def run_config(workdir: str) -> ml_collections.ConfigDict:
    """The resolved config a job wrote to `workdir/config.json`."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise ConfigError(f"{workdir!r} has no config.json: it is not an rlvr workdir (the --workdir of a finished "
                          "job).")
    with open(path) as f:
        return ml_collections.ConfigDict(json.load(f))


# --- the architecture ------------------------------------------------------------------------------

def checkpoint_model(src: Source) -> ModelConfig | None:
    """The architecture stored with the starting checkpoint (None for random init)."""
    if src.kind == "hf":
        from rlvr.models import hf

        path = os.path.join(src.path, "config.json")
        if not os.path.exists(path):
            raise ConfigError(f"init.hf_checkpoint={src.path!r} has no config.json; give a Hugging Face model "
                              "directory (config.json, *.safetensors, tokenizer files).")
        with open(path) as f:
            try:
                return hf.config_from_hf(json.load(f))
            except ValueError as e:
                raise ConfigError(f"init.hf_checkpoint={src.path!r}: {e}") from None
    if src.kind == "workdir":
        return ModelConfig.from_mapping(run_config(src.path).model)
    return None


def _explicit(model: ml_collections.ConfigDict) -> dict:
    return {k: v for k, v in model.items() if k != "preset" and v is not None}


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """The architecture the job runs (the checkpoint's, with the config's runtime fields), or for
    random init `model.preset` + `model.*`, with the config's adapters (`lora.*`). Raises ConfigError
    on a contradiction."""
    cfg = _architecture(config)
    try:
        lora = LoraConfig.from_mapping(config.get("lora"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if lora.quantize != "none":
        widths = {"model.hidden_size": cfg.hidden_size, "model.intermediate_size": cfg.intermediate_size,
                  "model.num_heads x model.head_dim": cfg.num_heads * cfg.head_dim}
        bad = {k: v for k, v in widths.items() if v % lora.quant_block}
        if bad:
            raise ConfigError(f"lora.quant_block={lora.quant_block} must divide every projection's input width "
                              f"({', '.join(f'{k}={v}' for k, v in bad.items())}): pick a divisor, e.g. 32.")
    return dataclasses.replace(cfg, lora=lora)


def validate(config: ml_collections.ConfigDict, num_devices: int, jobs: dict | None = None) -> None:
    """`config_lib.validate` against the architecture the job runs (`model_config`: a starting
    checkpoint's, read here). Raises ConfigError naming the field."""
    config_lib.validate(config, num_devices, jobs, model_config)


def run_source(config: ml_collections.ConfigDict, workdir: str) -> Source:
    """Where the job in `workdir` started: its RL warm start's SFT run (WORKDIR/sft, when
    rl.sft_steps > 0), else `source(config)`. A LoRA run's frozen base is that starting point."""
    if config.job == "rl" and config.rl.get("sft_steps", 0):
        return Source("workdir", os.path.join(workdir, "sft"))
    return source(config)


def _architecture(config: ml_collections.ConfigDict) -> ModelConfig:
    src = source(config)
    try:
        if src.kind == "random":
            return ModelConfig.from_mapping(config.model)
        stored = checkpoint_model(src)
        explicit = _explicit(config.model)
        if "vision" in explicit:
            explicit["vision"] = VisionConfig.of(explicit["vision"])
        wrong = {k: (v, getattr(stored, k)) for k, v in explicit.items()
                 if k not in (*RUNTIME_FIELDS, "value_head") and v != getattr(stored, k)}
        if wrong:
            listed = ", ".join(f"model.{k}={v!r} (checkpoint: {c!r})" for k, (v, c) in sorted(wrong.items()))
            raise ConfigError(f"{listed} contradict{'s' if len(wrong) == 1 else ''} the architecture of "
                              f"{src.describe()}: drop {'this override' if len(wrong) == 1 else 'these overrides'} "
                              "(the checkpoint's architecture is used).")
        runtime = {k: v for k, v in explicit.items() if k in (*RUNTIME_FIELDS, "value_head")}
        if src.kind == "hf":  # runtime fields from the config, else the defaults (an HF config has none)
            defaults = ModelConfig()
            stored = dataclasses.replace(stored, **{k: getattr(defaults, k) for k in RUNTIME_FIELDS})
        return dataclasses.replace(stored, **runtime)
    except ConfigError:
        raise
    except ValueError as e:  # a model.* value ModelConfig refuses
        raise ConfigError(str(e)) from None


# --- the tokenizer ---------------------------------------------------------------------------------

def _digest(directory: str) -> str:
    with open(os.path.join(directory, "tokenizer.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


def _require_tokenizer(directory: str, field: str, fix: str) -> None:
    if not os.path.exists(os.path.join(directory, "tokenizer.json")):
        present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        raise ConfigError(f"{field}={directory!r} has no tokenizer.json (files there: {present[:8]}); {fix}")


def template_text(value: str) -> str:
    """`tokenizer.chat_template`: a builtin name ('chatml'), a jinja template, or a path to one."""
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    if "{{" in value or "{%" in value:
        return value
    path = os.path.expanduser(value)
    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer.chat_template={value!r} is neither a template, a file nor one of "
                          f"{sorted(BUILTIN_TEMPLATES)}; give a jinja template or a .jinja file.")
    with open(path, encoding="utf-8") as f:
        return f.read()


def _recorded_tokenizer(workdir: str) -> tuple[str, str]:
    """(tokenizer directory, system prompt) a workdir records; workdirs from before the record: the
    tokenizer its config named (or byte-level, "")."""
    recorded = run_config(workdir)
    system = recorded.tokenizer.get("system_prompt", "")
    own = os.path.join(workdir, TOKENIZER_DIR)
    if os.path.isdir(own):
        _require_tokenizer(own, "init.workdir's tokenizer", "the workdir is incomplete: rerun its job, or give "
                           "init.hf_checkpoint instead.")
        return own, system
    return recorded.tokenizer.get("path", "") or recorded.init.get("hf_checkpoint", ""), system


def tokenizer_settings(config: ml_collections.ConfigDict) -> dict[str, str]:
    """`tokenizer.*` as the job runs them: the directory the tokenizer comes from ("" = byte-level),
    the chat template override and the system prompt. Raises ConfigError on a contradiction."""
    src, tok = source(config), config.tokenizer  # (configs recorded before chat settings existed lack them)
    path, template, system = os.path.expanduser(tok.path), tok.get("chat_template", ""), tok.get("system_prompt", "")
    if src.kind == "random":
        if path:
            _require_tokenizer(path, "tokenizer.path", "give a Hugging Face tokenizer directory, or '' for the "
                               "byte-level tokenizer.")
        return {"path": path, "chat_template": template, "system_prompt": system}
    if src.kind == "hf":
        own = src.path if os.path.exists(os.path.join(src.path, "tokenizer.json")) else ""
        if path:
            _require_tokenizer(path, "tokenizer.path", "give the model's tokenizer directory.")
            if own and _digest(path) != _digest(own):
                raise ConfigError(f"tokenizer.path={path!r} differs from the tokenizer of init.hf_checkpoint="
                                  f"{src.path!r} (tokenizer.json {_digest(path)} vs {_digest(own)}): drop "
                                  "tokenizer.path (the checkpoint's tokenizer is used).")
        elif not own:
            _require_tokenizer(src.path, "init.hf_checkpoint", "set tokenizer.path to the model's tokenizer "
                               "directory (rlvr never falls back to the byte-level tokenizer for a checkpoint).")
        return {"path": path or own, "chat_template": template, "system_prompt": system}
    recorded_path, recorded_system = _recorded_tokenizer(src.path)
    wrong = []
    if path and (not recorded_path or _digest(path) != _digest(recorded_path)):
        wrong.append(f"tokenizer.path={path!r} (the workdir's: {recorded_path or 'byte-level'})")
    if template and recorded_path:
        recorded_template = Tokenizer.from_dir(recorded_path).chat_template
        if template_text(template) != recorded_template:
            wrong.append(f"tokenizer.chat_template={template!r} (the workdir's differs: see "
                         f"{os.path.join(recorded_path, 'chat_template.jinja')})")
    if system and system != recorded_system:
        wrong.append(f"tokenizer.system_prompt={system!r} (the workdir's: {recorded_system!r})")
    if wrong:
        raise ConfigError(f"{'; '.join(wrong)} contradict{'s' if len(wrong) == 1 else ''} what init.workdir="
                          f"{src.path!r} was trained with: drop {'it' if len(wrong) == 1 else 'them'} (the "
                          "workdir's are used; every job of a chain sees the same prompts).")
    return {"path": recorded_path, "chat_template": "" if recorded_path else template, "system_prompt": recorded_system}


def build_tokenizer(settings: ml_collections.ConfigDict | dict) -> Tokenizer:
    """The tokenizer of resolved `tokenizer.*` settings, chat template and system prompt applied."""
    base = Tokenizer.from_dir(settings["path"]) if settings["path"] else byte_level_tokenizer()
    template = template_text(settings["chat_template"]) if settings.get("chat_template") else None
    try:
        return base.with_chat(template, settings.get("system_prompt", ""))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_vocab(cfg: ModelConfig, tokenizer: Tokenizer, where: str = "") -> None:
    """The tokenizer's ids must exist in the model's embedding."""
    if tokenizer.vocab_size > cfg.vocab_size:
        fix = ("the tokenizer does not belong to this model: set tokenizer.path to the model's tokenizer"
               if where else "raise model.vocab_size or give the model's tokenizer (tokenizer.path)")
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size={cfg.vocab_size}"
                          f"{f' ({where})' if where else ''}: {fix}.")


# --- resolving and recording -------------------------------------------------------------------------

def resolve(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The config the job runs (see the module docstring); `config` is not changed."""
    return resolve_parts(config)[0]


def resolve_parts(config: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, ModelConfig, Tokenizer]:
    """(the config the job runs, its architecture with adapters, its tokenizer): `resolve` with the
    values it derives on the way (`rlvr.job.resolve` keeps them)."""
    from rlvr import budgets

    src = source(config)
    cfg = model_config(config)
    settings = tokenizer_settings(config)
    tokenizer = build_tokenizer(settings)
    check_vocab(cfg, tokenizer, "" if src.kind == "random" else src.describe())
    out = config.copy_and_resolve_references()
    out.unlock()
    for key, value in cfg.to_dict().items():
        out.model[key] = value
    for key, value in settings.items():
        out.tokenizer[key] = value
    if config.job in ("rl", "eval"):
        episodic = budgets.resolve(out, tokenizer, run_config(src.path) if src.kind == "workdir" else None)
        if episodic or config.rl.agent:
            try:
                check_tool_calls(tokenizer, f"rl.task ({', '.join(episodic)})" if episodic else "rl.agent")
            except ValueError as e:
                raise ConfigError(str(e)) from None
    out.lock()
    return out, cfg, tokenizer


def write_workdir(config: ml_collections.ConfigDict, workdir: str) -> None:
    """What a job writes before it runs: config.json, versions.json (rlvr.observe) and the tokenizer."""
    from rlvr import observe

    observe.write_run_info(config, workdir)
    record(config, workdir)


def record(config: ml_collections.ConfigDict, workdir: str) -> str:
    """Copies the job's tokenizer (its chat template override written in) to WORKDIR/tokenizer/."""
    import jax

    target = os.path.join(workdir, TOKENIZER_DIR)
    if jax.process_index() != 0:
        return target
    os.makedirs(target, exist_ok=True)
    path = config.tokenizer.path
    if not path:
        byte_level_tokenizer().save(target)
    elif os.path.realpath(path) != os.path.realpath(target):
        for name in TOKENIZER_FILES:
            if os.path.exists(os.path.join(path, name)):
                shutil.copyfile(os.path.join(path, name), os.path.join(target, name))
        _keep_special_tokens(Tokenizer.from_dir(path), target)
    if config.tokenizer.chat_template:
        write_chat_template(target, template_text(config.tokenizer.chat_template))
    return target


def _keep_special_tokens(source_tok: Tokenizer, target: str) -> None:
    """Special tokens found through the model's config.json (not copied) go into tokenizer_config.json."""
    copied = Tokenizer.from_dir(target)
    if copied.special_tokens == source_tok.special_tokens:
        return
    path = os.path.join(target, "tokenizer_config.json")
    values = json.load(open(path)) if os.path.exists(path) else {}
    values.update(source_tok.special_tokens)
    with open(path, "w") as f:
        json.dump(values, f, indent=2, ensure_ascii=False)


def workdir_tokenizer(workdir: str) -> Tokenizer:
    """The tokenizer a job in `workdir` used, chat template and system prompt applied."""
    path, system = _recorded_tokenizer(workdir)
    return build_tokenizer({"path": path, "chat_template": "", "system_prompt": system})
