"""What `accelerate launch` asks of a run, read from the environment it starts the script in.

`accelerate launch` is two things: a launcher (with `--multi_gpu` it runs torchrun, whose
RANK / WORLD_SIZE / MASTER_ADDR this application reads as it does under torchrun itself),
and settings that accelerate's `Accelerator` reads from ACCELERATE_* environment variables.
This application builds no `Accelerator` (expert parallelism needs its own process groups),
so it reads those variables here, and each one is either honoured or refused in one line,
never ignored:

    --mixed_precision no | bf16   ACCELERATE_MIXED_PRECISION      train.dtype fp32 | bf16
    --cpu                         ACCELERATE_USE_CPU              device cpu
    (DeepSpeed's, or set by hand) ACCELERATE_GRADIENT_ACCUMULATION_STEPS  train.grad_accum_steps

accelerate's bf16 is autocast over fp32 weights, which is what train.dtype bf16 does with the
adamw optimizer; its "no" is no autocast: fp32. "no" is also what accelerate passes when
`--mixed_precision` is not given, so under `accelerate launch` a run is fp32 unless asked for
bf16, as for any script accelerate launches. A setting the config or the command line also
gives, with another value, is refused by `config.load_config` (drop one of the two).

Refused: fp16 and fp8 mixed precision, torch.compile (dynamo), FSDP / DeepSpeed / Megatron
plugins (this application shards with `--sharding fsdp`), and any other ACCELERATE_* variable
that asks for something (a value other than false / no / 0 / empty).

One launch is refused for what it does rather than for a variable: `accelerate launch --cpu
--num_processes 2` starts ONE process (accelerate starts more CPU processes only through
MPI, `--mpirun_hostfile`), which would silently train alone. `accelerate launch --multi_gpu
--num_processes 2` starts two on a CPU machine too (torchrun underneath; gloo).
"""

from collections.abc import Mapping

from te_mixtral.errors import UserError

PRECISIONS = {"no": "fp32", "bf16": "bf16"}  # accelerate's mixed_precision -> train.dtype

HONOURED = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS")

# Why a variable that asks for something is refused, where there is more to say than its name.
REFUSED = {
    "ACCELERATE_USE_FSDP": "accelerate's FSDP plugin wraps a model this application shards itself: use --sharding fsdp",
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed is not supported: use --sharding fsdp and --optimizer master_adamw",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM is not supported: expert parallelism is --ep-size",
    "ACCELERATE_DYNAMO_BACKEND": "torch.compile is not supported: drop --dynamo_backend",
}

# Variables that only detail another setting, by prefix -> that setting: accelerate sets them
# with it (the dynamo ones always, the fp8 ones with --mixed_precision fp8), and that setting
# alone is honoured or refused, with its own reason.
DETAILS = {"ACCELERATE_DYNAMO_": "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_FP8_": "ACCELERATE_MIXED_PRECISION"}

_FALSE = ("", "false", "no", "0", "none", "off", "n", "f")  # accelerate's str_to_bool, and "nothing asked"


def _refuse(variable: str, value: str, why: str) -> UserError:
    return UserError(f"accelerate launch setting {variable}={value} is not supported: {why}")


def _refuse_processes(environ: Mapping[str, str]) -> None:
    """Refuse the simple launcher's lone process when more were asked for. That launcher
    (`--cpu`, or one GPU) sets ACCELERATE_USE_CPU, never WORLD_SIZE, and sets MASTER_ADDR
    only when `--num_processes` or `--num_machines` is above 1."""
    if "ACCELERATE_USE_CPU" in environ and "MASTER_ADDR" in environ and "WORLD_SIZE" not in environ:
        raise UserError("accelerate launch started one process where more were asked for (its --cpu launcher starts "
                        "more only through MPI): run `accelerate launch --multi_gpu --num_processes N "
                        "run_finetune_ep.py` (torchrun underneath; add --device cpu on a GPU machine) or "
                        "`torchrun --nproc_per_node N run_finetune_ep.py`")


def _refuse_the_rest(environ: Mapping[str, str]) -> None:
    """Refuse every ACCELERATE_* variable not honoured here that asks for something."""
    # The variables with more to say first: DeepSpeed's own come with ACCELERATE_USE_DEEPSPEED.
    for variable in sorted(environ, key=lambda variable: (variable not in REFUSED, variable)):
        if not variable.startswith("ACCELERATE_") or variable in HONOURED:
            continue
        if any(variable.startswith(prefix) and variable != setting for prefix, setting in DETAILS.items()):
            continue
        if environ[variable].lower() not in _FALSE:
            raise _refuse(variable, environ[variable], REFUSED.get(variable, "te_mixtral does not read it"))


def launch_settings(environ: Mapping[str, str]) -> dict[str, tuple[object, str]]:
    """The config values `accelerate launch` asked for, as `config.load_config(launch=...)`
    takes them: full key -> (value, the accelerate flag that asked for it). Empty outside
    accelerate; a `UserError` naming the setting for anything refused."""
    _refuse_processes(environ)
    _refuse_the_rest(environ)
    settings = {}
    precision = environ.get("ACCELERATE_MIXED_PRECISION", "").lower()
    if precision:
        if precision not in PRECISIONS:
            why = ("8-bit expert GEMMs are a tier here: --tier device_mxfp8 with --mixed_precision bf16"
                   if precision == "fp8" else "train.dtype is fp32 or bf16 (bf16 needs no loss scaling): "
                   "use --mixed_precision bf16")
            raise _refuse("ACCELERATE_MIXED_PRECISION", precision, why)
        settings["train.dtype"] = (PRECISIONS[precision], f"accelerate launch --mixed_precision {precision}")
    if environ.get("ACCELERATE_USE_CPU", "").lower() not in _FALSE:
        settings["device"] = ("cpu", "accelerate launch --cpu")
    steps = environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "auto")
    if steps != "auto":  # accelerate's own "not set"
        if not steps.isdigit() or int(steps) < 1:
            raise _refuse("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", steps, "it must be a whole number above 0")
        settings["train.grad_accum_steps"] = (int(steps), f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS={steps}")
    return settings


def describe(settings: dict[str, tuple[object, str]]) -> str:
    """One line for the log: what accelerate's settings set."""
    return "te_mixtral: from accelerate launch: " + ", ".join(
        f"{key} {value} ({origin})" for key, (value, origin) in settings.items())
