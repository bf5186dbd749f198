"""The training loop: one plain function, read top to bottom.

Warm-up and timed steps run the same code; `metrics.summarize` leaves the first
`train.timing_warmup_steps` out of the statistics (of this process: a resumed run warms up
again). Evaluation, checkpoints and exports run between steps, outside the timed part.

Whatever can be checked before the first step is (the outputs, the loss-check reference,
the generate prompt, the free space), so a run never fails after training for a reason it
could have given before. A step whose loss or gradient norm is not finite is not applied:
the run stops there, writes results.json with the losses so far, and exits with
`ExitCode.DIVERGED`; a save refuses weights that are not finite the same way.
"""

import contextlib
import math
import signal
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import datasets
import torch
from torch import nn

from te_mixtral.config import RunConfig
from te_mixtral.data.packing import PackedData
from te_mixtral.data.sources import check_source
from te_mixtral.distributed.launcher_env import main_rank_from_env, world_size_from_env
from te_mixtral.distributed.layout import (
    Layout,
    all_reduce_sum,
    init_layout,
    require_a_gpu_of_its_own,
    shutdown,
)
from te_mixtral.distributed.parallelize import (
    parallelize,
    reduce_gradients,
    set_gradient_sync,
)
from te_mixtral.distributed.placement import ExpertPlacement
from te_mixtral.errors import (
    Diverged,
    ExitCode,
    Interrupted,
    UserError,
    WriteFailed,
    report_error,
    report_line,
)
from te_mixtral.experts.base import ExpertTier
from te_mixtral.experts.loop import LoopTier
from te_mixtral.experts.registry import BASELINES, make_tier
from te_mixtral.folder_lock import FolderLocks
from te_mixtral.lora_config import require_adapter_revision
from te_mixtral.measure import expert_load, metrics, report
from te_mixtral.measure.loss_check import check_reference
from te_mixtral.measure.phases import profile_phases
from te_mixtral.measure.run_log import RunLog
from te_mixtral.measure.trackers import check_trackers
from te_mixtral.model.hf_config import hub_revision, resolve_model_path
from te_mixtral.model.hf_model import HFMixtral
from te_mixtral.model.layers import TORCH, Backend, resolve_backend
from te_mixtral.model.lora import add_adapters, base_weights
from te_mixtral.model.mixtral import MixtralForCausalLM, init_weights
from te_mixtral.planning.memory import check_fits
from te_mixtral.training.checkpoint import Checkpointer, TrainState, tokenizer_sha256
from te_mixtral.training.evaluate import evaluate
from te_mixtral.training.exchange_capacity import ExchangeCapacity
from te_mixtral.training.expert_placement import run_placement
from te_mixtral.training.generate import encode_prompt, generate_text
from te_mixtral.training.hf_checkpoint import (
    adopt_checkpoint,
    base_sha256,
    check_export_space,
    load_hf_weights,
    save_hf_checkpoint,
)
from te_mixtral.training.optimizer import (
    clip_gradients,
    learning_rate,
    make_optimizer,
    optimizer_step,
    split_masters,
)
from te_mixtral.training.outputs import check_outputs, check_writable_folders
from te_mixtral.training.peft_adapters import load_adapter, save_adapter
from te_mixtral.training.restart import after_a_lost_peer, continue_restarted
from te_mixtral.training.run_report import Measured, report_run
from te_mixtral.training.same_job import job_summary, require_same_job


def build_model(cfg: RunConfig, layout: Layout, device: torch.device, model_dir: Path | None = None,
                placement: ExpertPlacement | None = None) -> tuple[nn.Module, dict]:
    """The model of the run's tier, with the weights of `model_dir` (an HF checkpoint) or
    initialised from the run's seed, its experts placed by `placement` (None: in order); and
    what it runs on."""
    if cfg.tier in BASELINES:  # transformers' model: ours built only for its weights
        with torch.device(device):
            ours = MixtralForCausalLM(cfg.model, TORCH, layout, LoopTier())
        initialise(ours, cfg, layout, model_dir)
        return HFMixtral.from_model(ours, BASELINES[cfg.tier]["experts"]), dict(BASELINES[cfg.tier])
    tier, backend = runs_here(cfg, device)
    # LoRA's frozen base is made in the compute dtype: an fp32 copy of the whole model first
    # would need twice the memory the run does.
    base_dtype = torch.bfloat16 if cfg.lora.enabled and cfg.precision == "bf16" else torch.float32
    with torch.device(device), default_dtype(base_dtype):
        model = MixtralForCausalLM(cfg.model, backend, layout, tier, cfg.train.recompute, cfg.train.recompute_layers,
                                   frozen_base=cfg.lora.enabled, ep_chunks=cfg.ep_chunks, placement=placement)
    initialise(model, cfg, layout, model_dir)
    if cfg.lora.enabled:
        add_adapters(model, cfg.lora, cfg.train.seed, layout)
    if cfg.lora.enabled and cfg.lora.init is not None and not cfg.resume:  # resumed: the checkpoint's, trained since
        load_adapter(model, cfg.lora.init, cfg, layout)
    return model, {"backend": backend.name, "experts": cfg.tier, **tier.describe()}


def runs_here(cfg: RunConfig, device: torch.device) -> tuple[ExpertTier, Backend]:
    """The run's expert tier and layer backend, or a one-line `UserError` where this machine
    cannot run them (a tier's `TierUnavailable`, the te backend without CUDA or TE)."""
    tier = make_tier(cfg.tier, cfg)
    tier.check_available(device)
    return tier, resolve_backend(cfg.backend, device.type, cfg.te_fusions)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """The dtype new floating-point tensors get, for the time of a `with` block."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def initialise(model: MixtralForCausalLM, cfg: RunConfig, layout: Layout, model_dir: Path | None) -> None:
    if cfg.resume and not cfg.lora.enabled:
        return  # the training checkpoint overwrites every weight (with LoRA, only the adapters)
    if model_dir is not None:
        load_hf_weights(model, model_dir, layout)
    else:
        init_weights(model, cfg.train.seed, layout)


def trained_note(model: nn.Module) -> str:
    """How many of the parameters train (LoRA's adapters), as the start line says it."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f" ({trained / 1e6:.2f} M of them LoRA adapters, trained)"


def due(step: int, every: int, total: int) -> bool:
    """Whether something done every `every` steps (0: never) and at the end is due after `step`."""
    return step == total or (every > 0 and step % every == 0)


def stop_on_interrupt(state: TrainState, checkpointer: Checkpointer | None, total: int) -> None:
    """From now on, Ctrl-C ends the run with one line on every rank (each gets the signal,
    and torchrun sends another) saying where it stopped and what to resume from."""
    def interrupted(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the second SIGINT must not interrupt the message
        last = checkpointer.last_saved() if checkpointer else None
        raise Interrupted(f"interrupted at step {state.step} of {total}; " + (
            f"the last checkpoint is {last} (continue with --resume)" if last else "no checkpoint was written"))
    signal.signal(signal.SIGINT, interrupted)


@dataclass
class TrainResult:
    exit_code: int  # ExitCode.OK, or LOSS_CHECK_FAILED
    losses: list[float]
    model: nn.Module
    optimizer: torch.optim.Optimizer


def train(cfg: RunConfig, config_path: str | None = None, locks: FolderLocks | None = None) -> TrainResult:
    """Run the configured job; `config_path` is the `--config` file it was read from. With
    `locks`, rank 0 locks the output, checkpoint and export folders into it against a second run."""
    # --- setup -------------------------------------------------------------------------
    device = torch.device(cfg.resolved_device())
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for but PyTorch sees no CUDA GPU")
    if device.type == "cuda":
        require_a_gpu_of_its_own()
    if device.type == "cuda" and cfg.precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise UserError("this GPU does not support bf16; use --dtype fp32")
    reference = report.read_results(cfg.loss_check)["losses"] if cfg.loss_check else None
    cfg = continue_restarted(cfg)  # torchrun's --max-restarts: a restart continues its launch's checkpoint
    # Local checks before the first collective, so that every rank fails alike and at once.
    check_writable_folders(cfg)
    model_dir = resolve_model_path(cfg.model_path) if cfg.model_path else None
    if model_dir is not None:
        cfg = adopt_checkpoint(cfg, model_dir, world_size_from_env())
        require_adapter_revision(cfg, hub_revision(model_dir))
    # What this machine cannot run or read, asked again where it is used: here, before the
    # estimate and the data, so that its line is the only one a run prints. On CUDA the tier
    # is asked in build_model alone: its check may import TE, which must not touch a GPU before
    # init_layout has given this rank its own.
    if cfg.tier not in BASELINES and device.type != "cuda":
        runs_here(cfg, device)
    check_source(cfg.data)
    placement = run_placement(cfg)

    def claim(*keys: str, beside: bool = False) -> None:
        """Rank 0 locks the folders these config keys name against a second run."""
        if locks is not None and main_rank_from_env():
            for key in keys:
                if getattr(cfg, key) is not None:
                    locks.claim(Path(getattr(cfg, key)), key, beside)

    claim("output_dir", "checkpoint_dir")  # first: a folder in use is refused as such
    check_outputs(cfg, model_dir, config_path)
    # After the checks: they refuse what no export may write into. Locked from beside: an
    # export holds only what its readers need (te_mixtral/folder_lock.py).
    claim("save_hf", "save_adapter", beside=True)
    check_trackers(cfg)
    # Refuse a run that cannot fit before anything big is allocated (the table says why).
    estimate = check_fits(cfg, world_size_from_env(), device.type)
    layout = init_layout(cfg.ep_size, device.type, cfg.dist_timeout_s)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(cfg.train.seed)

    if not layout.is_main:
        datasets.disable_progress_bars()  # datasets' tokenizing bars: rank 0's is enough
    data = PackedData(cfg.data, cfg.train.batch_size, layout.rank, layout.world_size, cfg.train.seed,
                      cfg.train.grad_accum_steps)
    if data.tokenizer.vocab_size > cfg.model.vocab_size:
        raise UserError(f"the tokenizer has {data.tokenizer.vocab_size} tokens but model.vocab_size is "
                        f"{cfg.model.vocab_size}")
    require_same_job(job_summary(cfg, data, model_dir, placement), layout)  # before any collective that would depend on it
    eval_batches = data.eval_batches()
    model, ran_on = build_model(cfg, layout, device, model_dir, placement)
    if reference is not None:
        check_reference(reference, cfg.train.steps, ran_on.get("precision", cfg.precision), cfg.loss_check)
    if cfg.generate is not None:
        encode_prompt(data.tokenizer, cfg.generate, cfg.model.max_position_embeddings, cfg.generate_tokens)
    remainders = split_masters(model, cfg)  # master_adamw: bf16 parameters, split before sharding
    parallelize(model, layout, cfg.train.sharding)
    optimizer = make_optimizer(model, cfg, remainders)
    del remainders  # the optimizer holds what it needs (its shards)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.precision == "bf16"
                else contextlib.nullcontext())
    export_dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    checkpointer = None
    if cfg.checkpoint_dir:  # a LoRA checkpoint holds the adapters alone: it records the base they train over
        base_hash = base_sha256(model_dir) if cfg.lora.enabled and model_dir is not None else None
        checkpointer = Checkpointer(cfg, layout, device, tokenizer_sha256(data.tokenizer), base_hash)
    state = checkpointer.load_latest(model, optimizer, cfg) if cfg.resume else TrainState()
    stop_on_interrupt(state, checkpointer, cfg.train.steps)
    if checkpointer:
        checkpointer.check_free_space(model)
    if cfg.save_hf:
        check_export_space(model, cfg.save_hf, layout, export_dtype)
    header = {**report.run_header(cfg, metrics.device_name(device), layout.world_size), "ran": ran_on}
    output_dir = report.prepare_output_dir(cfg.output_dir, cfg.tier) if layout.is_main else None
    if locks is not None and layout.is_main and cfg.output_dir is None:  # a new folder, locked as it is made
        locks.claim(output_dir, "output_dir")
    if layout.is_main and model_dir is not None:
        print(f"te_mixtral: weights and model config from {model_dir} (its config.json replaces the config's "
              f"model section)", flush=True)
    if layout.is_main and cfg.lora.enabled and cfg.lora.init is not None:
        lora = cfg.lora
        print(f"te_mixtral: note: lora.init {lora.init} is not read: the checkpoint holds the adapters as they "
              f"trained since" if cfg.resume else
              f"te_mixtral: LoRA adapters from {lora.init} (lora.rank {lora.rank}, alpha {lora.alpha:g}"
              f"{', rslora' if lora.rslora else ''}, targets {lora.targets}); the optimizer starts afresh", flush=True)
    if layout.is_main:
        print(f"te_mixtral: tier {cfg.tier} on {header['device']} x{layout.world_size} (EP={cfg.ep_size}), "
              f"{cfg.precision}, {sum(w.numel() for w in base_weights(model).values()) / 1e6:.1f} M parameters on rank 0"
              f"{trained_note(model) if cfg.lora.enabled else ''}, "
              f"ran: {ran_on}", flush=True)

    # --- steps -------------------------------------------------------------------------
    exchange = ExchangeCapacity(cfg.ep_capacity)
    exchange.resume(state.exchange, layout.is_main)
    exchange.start(model)
    timer = metrics.StepTimer(device)
    flops_per_step = []
    first_step = state.step + 1  # counted from 1; a resumed run starts later
    # Rank 0's; inert elsewhere. Its trackers go on in the checkpoint's runs, which the next checkpoints keep.
    run_log = RunLog(output_dir, cfg, first_step, cfg.train.steps, state.run_id, state.tracker_runs)
    state.tracker_runs = run_log.tracker_runs
    run_load_YE = None  # tokens per layer and expert over this process's steps, for the results page
    stopped = None  # why the run stopped early (a Diverged error), if it did
    saved = {}  # what this run wrote, by kind (on rank 0): the last of each, said at the end

    def export() -> None:  # each save refuses non-finite weights, on every rank
        if cfg.save_hf:
            saved["HF export"] = save_hf_checkpoint(model, cfg.save_hf, layout, export_dtype, data.tokenizer,
                                                    model_dir, cfg.data.tokenizer, state.run_id)
        if cfg.save_adapter:
            saved["adapter"] = save_adapter(model, cfg.save_adapter, cfg, layout, data.tokenizer, state.run_id)

    for step in range(state.step, cfg.train.steps):
        micro_batches = data.micro_batches(step)
        step_flops = sum(metrics.train_flops(cfg.model, micro.packed.cu_seqlens, micro.num_tokens, cfg.lora)
                         for micro in micro_batches)
        micro_batches = [micro.to(device) for micro in micro_batches]
        lr = learning_rate(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr

        timer.start()
        # One all-reduce for both global totals of the whole step, every micro-batch of every
        # rank: target tokens and FLOPs. Each micro-batch's loss divides by the step's target
        # count, so the gradients the micro-batches add up are exactly one big batch's.
        targets = sum((micro.labels != -100).sum() for micro in micro_batches)
        totals = torch.stack([targets.double(), torch.tensor(step_flops, device=device, dtype=torch.float64)])
        all_reduce_sum(totals, layout)
        while True:  # once, unless a padded exchange was short (then again, with room enough)
            # The LM loss, then the router's two (a step's are its micro-batches' mean: see
            # model/router_losses.py), float64: they divide by totals.
            step_losses = torch.zeros(3, dtype=torch.float64, device=device)
            step_load_YE = 0
            for micro in micro_batches:  # gradients add up in .grad, one micro-batch after another
                set_gradient_sync(model, layout, cfg.train.sharding,
                                  micro is micro_batches[-1] or cfg.train.fsdp_reduce == "micro_batch")
                with autocast:
                    logits = model(micro.input_ids, micro.packed)
                loss = model.lm_loss(logits, micro.labels, totals[0])
                router = model.router_losses(layout)
                (loss + router.weighted(cfg.model) / len(micro_batches)).backward()
                step_losses += torch.stack([loss, router.aux / len(micro_batches),
                                            router.z / len(micro_batches)]).detach()
                step_load_YE = step_load_YE + router.tokens_per_expert_YE
            # Once per optimizer step: the sums the last micro-batch's backward started, awaited.
            reduce_gradients(model, layout, cfg.train.sharding)
            grad_norm, grad_scale = clip_gradients(optimizer, model, cfg.train.grad_clip, layout)  # global norm
            global_loss, global_aux, global_z, norm, *needed = torch.cat(
                [all_reduce_sum(step_losses, layout), grad_norm.to(step_losses.dtype)[None],
                 *exchange.needed(model, layout)]).tolist()
            if not exchange.short(needed):
                break
            # Some rank had more rows for another than its padded blocks held, and dropped
            # them: nothing of this step is applied; it runs again with room for them.
            optimizer.zero_grad(set_to_none=True)
            exchange.raise_to(model, needed[0], state.step + 1, layout.is_main)
            state.exchange = exchange.state()  # what the next checkpoint keeps
        state.losses.append(global_loss)
        state.grad_norms.append(norm)
        state.router.append(expert_load.step_record(global_aux, global_z, step_load_YE, model.placement))
        if not (math.isfinite(global_loss) and math.isfinite(norm)):  # the same two numbers on every rank
            run_log.step(step + 1, state, lr, None, metrics.peak_memory_bytes(device), print_line=False)
            stopped = Diverged(f"the loss became {global_loss} and the gradient norm {norm} at step {step + 1}; "
                               f"stopped without applying that step")
            break
        optimizer_step(optimizer, grad_scale)
        optimizer.zero_grad(set_to_none=True)
        step_s = timer.stop()

        state.step = step + 1
        run_load_YE = step_load_YE if run_load_YE is None else run_load_YE + step_load_YE
        flops_per_step.append(totals[1].item())
        run_log.step(state.step, state, lr, step_s, metrics.peak_memory_bytes(device),
                     print_line=due(state.step, cfg.train.log_every, cfg.train.steps))

        # --- between steps: evaluate, checkpoint, export (not timed) ---------------------
        if eval_batches and due(state.step, cfg.train.eval_every, cfg.train.steps):
            with exchange.exact(model):
                evaluation = evaluate(model, eval_batches, state.step, layout, device, autocast)
            state.evals.append(asdict(evaluation))
            run_log.evaluation(evaluation)
        try:  # a checkpoint that cannot be written fails on every rank alike: results.json keeps the run
            if checkpointer and due(state.step, cfg.train.checkpoint_every, cfg.train.steps):
                saved["checkpoint"] = checkpointer.save(state, model, optimizer, cfg)
        except WriteFailed as e:
            stopped = e
            break
        try:
            if due(state.step, cfg.train.save_every, cfg.train.steps):
                export()
        except Diverged as e:
            stopped = Diverged(f"after step {state.step}: {e}")
            break
    if first_step > cfg.train.steps:  # a finished run resumed to export (training/checkpoint.py): no step ran
        try:
            export()
        except Diverged as e:
            stopped = Diverged(f"after step {state.step}: {e}")

    # --- report ------------------------------------------------------------------------
    # In this order: generating adds to the peak memory, and profiling (last: it steps the
    # optimizer while timing it) adds to the tier's calls after they are counted.
    measured = Measured(state, first_step, timer.times, flops_per_step, run_load_YE, stopped,
                        exchange=exchange.record(), placement=model.placement)
    with exchange.exact(model):
        measured.generated = (generate_text(model, data.tokenizer, cfg.generate, cfg.generate_tokens, layout, device,
                                            autocast) if cfg.generate is not None and not stopped else None)
    measured.peaks_by_rank = metrics.by_rank(metrics.peak_memory_bytes(device), device, layout)
    measured.allocator_retries_by_rank = metrics.by_rank(metrics.allocator_retries(device), device, layout)
    measured.tier_calls = model.tier.calls() if isinstance(model, MixtralForCausalLM) else {}
    measured.saved = saved
    measured.phases = (profile_last_step(model, optimizer, micro_batches[-1], totals[0], autocast, layout, cfg)
                       if cfg.profile_phases and not stopped else None)
    exit_code = report_run(cfg, layout, measured, header=header, estimated_peak_bytes=estimate.total,
                           output_dir=output_dir, run_log=run_log, reference=reference)
    if stopped:
        raise stopped
    return TrainResult(exit_code, state.losses, model, optimizer)


def profile_last_step(model: nn.Module, optimizer: torch.optim.Optimizer, last, num_targets: torch.Tensor,
                      autocast, layout: Layout, cfg: RunConfig) -> tuple[dict, list[int]]:
    """`profile_phases` over the last step's last micro-batch, clipped and stepped as the loop does."""
    def forward_backward():
        with autocast:
            logits = model(last.input_ids, last.packed)
        model.lm_loss(logits, last.labels, num_targets).backward()

    def clip():
        return clip_gradients(optimizer, model, cfg.train.grad_clip, layout)[1]

    return profile_phases(
        model, clip, partial(optimizer_step, optimizer), forward_backward, last, num_targets, autocast, layout, cfg)


def _lost_a_peer(e: RuntimeError) -> bool:
    # gloo reports a dead or hung peer as a plain RuntimeError naming itself; NCCL and the
    # store raise torch.distributed.DistError subclasses.
    return isinstance(e, torch.distributed.DistError) or "gloo" in str(e)


def main(cfg: RunConfig, config_path: str | None = None) -> int:
    try:
        with FolderLocks() as locks:  # released however the run ends
            exit_code = train(cfg, config_path, locks).exit_code  # the same on every rank: the loss check is global
            shutdown(wait_for_peers=True)
        return exit_code
    except UserError as e:
        return report_error(e, world_size_from_env(), main_rank_from_env())
    except RuntimeError as e:
        if not _lost_a_peer(e):
            raise
        reason = (str(e).strip().splitlines() or ["no detail"])[0]
        return report_line(f"a collective failed, another rank probably died or hung (see its log); "
                           f"{after_a_lost_peer(cfg)} ({reason[:200]})", ExitCode.LOST_A_PEER,
                           world_size_from_env(), main_rank_from_env())
