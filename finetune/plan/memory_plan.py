"""The memory plan: what one device holds while a recipe trains, counted before anything loads.

Pure arithmetic over the model's configuration (instantiated on the meta device for exact parameter counts, no
weights) and the recipe: `finetune estimate`, the `auto` micro-batch, validation and the panel all call `plan()`.
Each line of a plan has a part that does not depend on the micro-batch and a part per row of `max_length` tokens,
so the largest micro-batch that fits follows from one plan.

What autograd keeps, per token of a decoder layer, is counted from the code paths transformers and PEFT take at our
pins (RMSNorm upcasts to float32, LoRA inputs cast to the adapter's float32 outside autocast, eager attention keeps
its probabilities); `benchmarks/memory.py` checks the totals against measured peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.errors import UserError
from finetune.models import backends
from finetune.plan.devices import MIB, Device, format_bytes
from finetune.plan.shapes import Shape

CUDA_CONTEXT = 600 * MIB  # the CUDA context and kernels of torch, cuBLAS and NCCL: outside torch's own counters
ALLOCATOR_SLACK = 0.06  # blocks the caching allocator holds but cannot hand out (fragmentation), of the tensors
# A CPU training process without the model: Python with torch, transformers, TRL and PEFT, the data, and the
# tokenizer, whose size follows its vocabulary (measured: 850 MiB with Llama 3.2's 128k tokens)
CPU_PROCESS = 580 * MIB
CPU_PROCESS_PER_TOKEN = 2200  # bytes per vocabulary entry
# glibc's malloc keeps freed blocks below its mmap threshold in its heap, and hands larger ones back to the system.
# Left to itself the threshold rises to 32 MiB as large blocks are freed, and a CPU run then keeps, for every layer,
# the forward's activations that gradient checkpointing frees (measured: 150 MiB a layer of the Qwen2.5-1.5B shape at
# 2 x 1024 tokens, 3.2 GiB of its 11.6 GiB peak). A CPU run fixes the threshold here (training/run.py), so only
# blocks below it stay: bitsandbytes' dequantized weights, one per Linear and pass, among them.
HEAP_BLOCK = 4 * MIB
TIGHT = 0.9  # above this share of the device a plan is "tight": fragmentation or a longer batch can tip it over

# Optimizer state bytes per trainable parameter (fp32 master parameters).
OPTIMIZER_BYTES = {
    "adamw_torch": 8, "adamw_torch_fused": 8, "adamw_torch_xla": 8, "adamw_torch_npu_fused": 8, "adamw_apex_fused": 8,
    "adamw_anyprecision": 8, "adamw_torch_8bit": 2, "adamw_torch_4bit": 1, "adafactor": 0.1, "sgd": 0, "adagrad": 4,
    "rmsprop": 4, "rmsprop_bnb": 4, "rmsprop_bnb_32bit": 4, "rmsprop_bnb_8bit": 1, "lion_32bit": 4,
    "paged_lion_32bit": 4, "lion_8bit": 1, "paged_lion_8bit": 1, "adamw_bnb_8bit": 2, "adamw_8bit": 2,
    "paged_adamw_8bit": 2, "paged_adamw_32bit": 8, "ademamix": 12, "ademamix_8bit": 3, "paged_ademamix_32bit": 12,
    "paged_ademamix_8bit": 3,
}
PAGED = "paged"  # bitsandbytes' paged optimizers move their state to CPU memory when the GPU runs short
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4 bits + an 8-bit absmax per 64 weights + an fp32 per 256 absmax (double quant)
LOSS_CHUNK = 256  # TRL's chunked_nll: tokens whose logits exist at once
# A step's loss runs after the forward and its gradient before the first layer's backward: what each holds for
# itself is freed before the other starts, so a step peaks in one of these phases, never in both at once.
LOSS, BACKWARD = "the loss", "the backward"


@dataclass(frozen=True)
class Launch:
    processes: int
    sharded: bool  # FSDP or DeepSpeed ZeRO-3: parameters, gradients and optimizer state split over the processes
    name: str


def launch_of(accelerate_config: dict | None, processes: int | None = None) -> Launch:
    """How the processes share the work, from an accelerate config (read as a mapping) or a process count."""
    config = accelerate_config or {}
    count = processes or int(config.get("num_processes") or 1) * int(config.get("num_machines") or 1)
    kind = str(config.get("distributed_type") or ("MULTI_GPU" if count > 1 else "NO"))
    zero = int((config.get("deepspeed_config") or {}).get("zero_stage") or 0)
    sharded = kind == "FSDP" or (kind == "DEEPSPEED" and zero == 3)
    engine = "FSDP" if kind == "FSDP" else f"DeepSpeed ZeRO-{zero}" if kind == "DEEPSPEED" else "DDP"
    return Launch(count, sharded, f"{engine} on {count} processes" if count > 1 else "one process")


@dataclass(frozen=True)
class Line:
    what: str
    fixed: float  # bytes whatever the micro-batch
    per_row: float = 0.0  # bytes per row of max_length tokens
    note: str = ""
    allocated: bool = True  # torch's allocator counts it (not the CUDA context, the slack, or the CPU process)
    phase: str = ""  # LOSS or BACKWARD: held only then; "" for the whole step

    def at(self, rows: int) -> float:
        return self.fixed + self.per_row * rows


@dataclass
class Plan:
    device: Device
    launch: Launch
    micro_batch: int
    max_length: int
    parameters: int = 0  # of the model
    trainable: int = 0  # the adapter's, or the model's for a full fine-tune
    lines: list[Line] = field(default_factory=list)
    # On the CPU: the resident peak while the weights load, the checkpoint file mapped beside them (file pages the
    # kernel may reclaim, which the steps' plan does not need, but which the process's peak resident memory counts)
    loading: float = 0.0

    def total(self, rows: int | None = None) -> float:
        """The step's peak: what it holds throughout, and the larger of what the loss and the backward add."""
        return self._peak(self.lines, rows)

    def tensors(self, rows: int | None = None) -> float:
        """What torch's allocator counts (torch.cuda.max_memory_allocated): all but the context and the slack."""
        return self._peak([line for line in self.lines if line.allocated], rows)

    def peak_phase(self, rows: int | None = None) -> str:
        return max((LOSS, BACKWARD), key=lambda phase: self._phase(self.lines, phase, rows))

    def _peak(self, lines: list[Line], rows: int | None) -> float:
        return self._phase(lines, "", rows) + max(self._phase(lines, LOSS, rows), self._phase(lines, BACKWARD, rows))

    def _phase(self, lines: list[Line], phase: str, rows: int | None) -> float:
        return sum(line.at(self.micro_batch if rows is None else rows) for line in lines if line.phase == phase)

    def measurable(self) -> float:
        """What `--probe` measures of it: torch's allocated peak on a GPU, the process's peak resident memory on the
        CPU (while loading or while training, whichever is higher)."""
        return self.tensors() if self.device.cuda else max(self.total(), self.loading)

    @property
    def largest_micro_batch(self) -> int:
        """The most rows of max_length tokens per device that fit (0: not even one)."""
        def fitting(phase: str) -> int:
            lines = [line for line in self.lines if line.phase in ("", phase)]
            per_row = sum(line.per_row for line in lines)
            room = self.device.capacity - sum(line.fixed for line in lines)
            return max(0, int(room // per_row)) if per_row else 0

        return min(fitting(LOSS), fitting(BACKWARD))

    @property
    def verdict(self) -> str:
        share = self.total() / self.device.capacity
        if share > 1:
            return "does not fit"
        return "fits, tightly" if share > TIGHT else "fits"


def micro_batch_of(recipe, device: Device, launch: Launch, shape: Shape) -> int:
    """The recipe's micro-batch; for `auto`, the largest that the plan fits and that splits the global batch into
    whole accumulation steps."""
    if not recipe.auto_micro_batch:
        return recipe.train_setting("per_device_train_batch_size")
    from finetune.recipe.train_section import GLOBAL_BATCH

    single = plan(recipe, shape, device, launch, 1)
    per_process = recipe.train_setting(GLOBAL_BATCH) // launch.processes
    fitting = [rows for rows in range(1, min(single.largest_micro_batch, per_process) + 1) if per_process % rows == 0]
    if not fitting:
        raise UserError(f"train.per_device_train_batch_size auto: not one row of {single.max_length} tokens fits "
                        f"on {device.name} (the plan needs {format_bytes(single.total())} of "
                        f"{format_bytes(device.capacity)}); " + _advice(single))
    return fitting[-1]


def plan(recipe, shape: Shape, device: Device, launch: Launch, rows: int) -> Plan:
    """The per-device memory of training `recipe` (a model of `shape`) on `device` under `launch`, with micro-batches
    of `rows` rows of max_length tokens."""
    length = recipe.train_setting("max_length") + (recipe.grpo.get("max_completion_length", GRPO_COMPLETION)
                                     if recipe.stage == "grpo" else 0)
    sequences = 2 if recipe.stage == "dpo" else 1  # DPO runs a row's chosen and rejected answers in one batch
    compute = _compute_bytes(recipe, shape, device)
    shard = launch.processes if launch.sharded else 1
    checkpointing = recipe.train_setting("gradient_checkpointing")
    attention = recipe.model.attn_implementation or shape.attention
    optim = str(recipe.train_setting("optim"))

    trainable = shape.adapter if recipe.method != "full" else shape.parameters
    plan_ = Plan(device, launch, rows, length, shape.parameters, trainable)
    add = plan_.lines.append
    weights = _weights(shape, recipe, compute, shard)
    add(weights)
    optimizer_bytes = OPTIMIZER_BYTES.get(optim, 8)  # others: counted as AdamW
    kind = "adapter" if recipe.method != "full" else "trained weights"
    parameter_bytes = 0 if recipe.method == "full" else 4  # a full fine-tune's parameters are the weights above
    add(Line(f"{kind}: gradients, optimizer", trainable * (parameter_bytes + 4 + optimizer_bytes) / shard,
             note=f"{count(trainable)} fp32 parameters{' (in weights above)' if recipe.method == 'full' else ''}, "
                  f"their gradients, {optim} state ({optimizer_bytes:g} B each)"
                  + (": paged, can spill to CPU memory" if PAGED in optim else "")))
    if launch.processes > 1 and not launch.sharded:
        add(Line("DDP gradient buckets", trainable * 4, note="a flat copy of the gradients for the all-reduce"))
    if launch.sharded:
        add(Line("gathered layer", shape.largest_layer * compute * 2,
                 note="one layer's full weights while it runs, and the next one prefetched"))
    # Eager attention keeps its probabilities for the backward; the CPU's sdpa kernel (masked, packed rows) keeps
    # only its output, but its backward holds the probabilities of one layer at a time.
    per_token, recomputed, working = _activations(shape, recipe, compute, attention, checkpointing, length,
                                                  kept=attention == "eager",
                                                  transient=attention == "sdpa" and not device.cuda)
    note = ("every layer's input (gradient checkpointing)" if checkpointing else
            "every layer's activations (no gradient checkpointing)") + f", {attention} attention"
    if recipe.train_setting("activation_offloading"):
        per_token = per_token * 2 / (shape.layers + 1)  # kept in CPU memory but for the layers at work
        note = "offloaded to CPU memory but for about two layers'"
    if sequences > 1:
        note += "; chosen and rejected answers: 2 sequences per row"
    add(Line("activations", 0, per_token * length * sequences, note=note))
    if checkpointing:
        add(Line("recomputed layer", 0, recomputed * length * sequences, phase=BACKWARD,
                 note="one layer's activations, recomputed for its backward"))
    add(Line("backward working set", 0, working * length * sequences, phase=BACKWARD,
             note="the gradients of one layer's activations"))
    add(_loss(shape, recipe, compute, length, rows) if recipe.stage == "sft" else
        _stage_loss(shape, recipe, compute, length))
    if recipe.stage == "grpo":
        add(Line("generation (KV cache)", 0, shape.layers * 2 * shape.kv_width * compute * length,
                 note="keys and values of each answer generated, prompt and up to "
                      f"{length - recipe.train_setting('max_length')} "
                      "new tokens"))
    if recipe.method == "qlora" and device.cuda:
        add(Line("4-bit dequantization", shape.largest_linear * compute, note="one layer's weight dequantized at a time"))
    elif recipe.method == "qlora":
        kept = [size for size in shape.layer_linears if size * compute < HEAP_BLOCK]
        add(Line("4-bit dequantization", shape.layers * sum(kept) * compute / shard,
                 note=f"dequantized weights up to {HEAP_BLOCK // MIB} MiB ({len(kept)} of {len(shape.layer_linears)} "
                      "a layer) stay in the C heap"))
    if device.cuda:
        add(Line("CUDA context", CUDA_CONTEXT, note="torch, cuBLAS and NCCL kernels; not in torch's counters",
                 allocated=False))
        tensors = plan_.tensors  # piecewise linear in the rows (the peak's phase may change): linear through these
        slope = (tensors(rows) - tensors(0)) / max(rows, 1)
        add(Line("allocator slack", tensors(0) * ALLOCATOR_SLACK, slope * ALLOCATOR_SLACK,
                 note=f"cached blocks the allocator cannot reuse, about {ALLOCATOR_SLACK:.0%}", allocated=False))
    else:
        process = CPU_PROCESS + CPU_PROCESS_PER_TOKEN * shape.vocab
        add(Line("process", process, note="Python, the libraries, the tokenizer and the data", allocated=False))
        # Weights kept in the checkpoint's own dtype are its mapped pages; others are built beside the mapped file
        copied = weights.fixed != shape.saved / shard
        plan_.loading = weights.fixed + (shape.saved / shard if copied else 0) + process
    return plan_


def _compute_bytes(recipe, shape: Shape, device: Device) -> int:
    """Bytes of one activation value: bf16/fp16 when the recipe (or the GPU default) trains in them, else fp32.
    Unsloth cannot run GPT-OSS or Gemma 3 in float16: asked to, it trains them in fp32 (UNSLOTH_FP32_FOR_FP16)."""
    if recipe.model.backend == "unsloth" and shape.model_type in backends.UNSLOTH_FP32_FOR_FP16 and (
            recipe.precision == "fp16" or recipe.model.dtype == "float16"):
        return 4
    if recipe.precision:
        return 4 if recipe.precision == "fp32" else 2
    return 2 if device.cuda else 4


def _weights(shape: Shape, recipe, compute: int, shard: int) -> Line:
    if recipe.method == "full":
        return Line("weights", shape.parameters * 4 / shard, note=f"{count(shape.parameters)} parameters, fp32")
    dtype = {"bfloat16": 2, "float16": 2, "float32": 4}.get(recipe.model.dtype, compute)
    name = {2: "bf16", 4: "fp32"}[dtype]
    if recipe.method == "qlora":
        # bitsandbytes through transformers quantizes Linear layers; Unsloth's 4-bit checkpoints also the experts
        quantized = shape.linear + (shape.experts if recipe.model.backend == "unsloth" else 0)
        rest = shape.parameters - quantized
        kept = ["embeddings", *(["head"] if shape.head else []), "norms",
                *(["experts"] if shape.experts and quantized == shape.linear else [])]
        return Line("weights", (quantized * NF4_BYTES + rest * dtype) / shard,
                    note=f"{count(quantized)} in NF4 with their constants; {count(rest)} "
                         f"({', '.join(kept)}) in {name}")
    note = f"{count(shape.parameters)} parameters in {name}"
    if shape.experts:
        note += " (MXFP4 experts dequantized)"
    return Line("weights", shape.parameters * dtype / shard, note=note)


def _activations(shape: Shape, recipe, b: int, attention: str, checkpointing: bool, length: int, kept: bool,
                 transient: bool) -> tuple[float, float, float]:
    """Bytes per token: kept for the backward, of the layer the backward recomputes (with checkpointing), and of the
    backward's working set on top.

    The attention probabilities, one float32 (Llama's eager softmax) or compute-dtype value per head and key
    position, are `kept` for the backward, or exist only in one layer's backward (`transient`)."""
    h, q, kv, i = shape.hidden, shape.q_width, shape.kv_width, shape.intermediate
    norms = (4 + b) * shape.norm_width  # RMSNorm keeps its float32 input and hands the normalized value on
    if attention == "flash_attention_2":
        attend = b * (3 * q + 2 * kv) + 4 * shape.heads  # q, k, v, output, o_proj input; log-sum-exp
    else:  # sdpa with a mask (packed rows) and eager repeat k and v over the query heads
        attend = b * 5 * q + 4 * shape.heads
    probabilities = shape.heads * length * (b if shape.model_type == "gpt_oss" or transient else 4)
    in_backward = probabilities if transient else 0
    probabilities = probabilities if kept else 0
    if shape.experts_per_token:
        mlp = shape.experts_per_token * (7 * i * b + h * b)  # per chosen expert: gate_up, gate, sigmoid, glu, output
    elif recipe.train_setting("use_liger_kernel"):
        mlp = 3 * i * b  # Liger's SwiGLU recomputes SiLU(gate) in the backward
    else:
        mlp = 4 * i * b  # gate, SiLU(gate), up, and their product (down_proj's input)
    adapters = 0
    if recipe.method != "full":
        # In 16-bit training PEFT casts each adapter's input to the adapter's float32 and autocast casts it back: a
        # 16-bit copy per adapted Linear. Dropout keeps its output and mask.
        cast = b if b == 2 else 0
        dropout = (b + 1) if recipe.lora.dropout else 0
        adapters = sum(inputs * (cast + dropout) + recipe.lora.r * 4 for inputs in shape.adapted_inputs)
    layer = norms + attend + probabilities + mlp + adapters
    outside = 2 * b * h + 4 * h  # embedding output, final norm
    # the backward of one layer: the gradients of its widest activations, and of the probabilities and scores
    working = 2 * max(i * (shape.experts_per_token or 1), q) * b + 2 * (probabilities + in_backward)
    if checkpointing:
        return shape.layers * b * h + outside, layer, working
    return shape.layers * layer + outside, 0, working


def _loss(shape: Shape, recipe, b: int, length: int, rows: int) -> Line:
    liger = recipe.train_setting("use_liger_kernel")
    if recipe.train_setting("loss_type") == "chunked_nll" and not liger:
        # TRL's chunk holds its float32 logits, their log-softmax, its exp and their product (the logged entropy);
        # soft-capping adds the scaled logits and their tanh. A micro-batch shorter than a chunk makes shorter tiles.
        tiles = 4 + (2 if shape.logit_softcapping else 0)
        tokens = min(LOSS_CHUNK, rows * length)
        return Line("loss (chunked)", tokens * shape.vocab * 4 * tiles, b * shape.hidden * length, phase=LOSS,
                    note=f"logits of {tokens} tokens at a time (TRL's chunked_nll)")
    if liger:
        return Line("loss (Liger fused)", 0, b * shape.hidden * length, phase=LOSS,
                    note="Liger's fused linear cross-entropy")
    return Line("loss (full logits)", 0, (b + 8) * shape.vocab * length, phase=LOSS,
                note="logits of every token, upcast to fp32, with their gradient")


GRPO_COMPLETION = 512  # GRPOConfig's max_completion_length


def _stage_loss(shape: Shape, recipe, b: int, length: int) -> Line:
    """TRL's DPO, KTO and GRPO take log-probabilities from the whole logits of a batch (no chunking): the logits,
    their gradient and their float32 log-softmax per sequence. The reference model's logits (the adapter off) are
    freed before the policy's forward."""
    sequences = 2 if recipe.stage == "dpo" else 1
    what = {"dpo": "chosen and rejected", "kto": "answers", "grpo": "generated answers"}[recipe.stage]
    return Line(f"log-probabilities ({recipe.stage})", 0, sequences * length * shape.vocab * (2 * b + 4), phase=LOSS,
                note=f"whole logits of the {what}, their gradient and float32 log-softmax (TRL does not chunk them)")


def describe(plan_: Plan, recipe_name: str) -> str:
    """The plan as the table `finetune estimate` prints."""
    rows = plan_.micro_batch
    with_adapter = plan_.parameters + (plan_.trainable if plan_.trainable != plan_.parameters else 0)
    lines = [f"Memory plan for {recipe_name} on {plan_.device.name}, {plan_.launch.name}: per device, a micro-batch "
             f"of {rows} x {plan_.max_length} tokens",
             f"Parameters: the model {plan_.parameters:,}; trainable params: {plan_.trainable:,} || all params: "
             f"{with_adapter:,} || trainable%: {100 * plan_.trainable / with_adapter:.4f}",
             ""]
    peak = plan_.peak_phase()
    total_what = f"total (at the peak: {peak})"
    width = max(len(total_what), *(len(line.what) for line in plan_.lines))
    for line in plan_.lines:
        held = f"; only in {line.phase}" + ("" if line.phase == peak else ", not at the peak") if line.phase else ""
        lines.append(f"  {line.what:<{width}}  {format_bytes(line.at(rows)):>9}  {line.note}{held}")
    total, capacity = plan_.total(), plan_.device.capacity
    lines += ["  " + "-" * (width + 11),
              f"  {total_what:<{width}}  {format_bytes(total):>9}  of {format_bytes(capacity)} "
              f"({total / capacity:.0%}): {plan_.verdict}",
              ""]
    if plan_.loading:
        lines[-1:-1] = [f"  {'while loading':<{width}}  {format_bytes(plan_.loading):>9}  the weights, the checkpoint "
                        "file mapped beside them where they are converted from its dtype (file pages the kernel can "
                        "reclaim) and the process"]
    largest = plan_.largest_micro_batch
    if largest:
        lines.append(f"Largest micro-batch that fits at max_length {plan_.max_length}: {largest}"
                     + (f" ({format_bytes(plan_.total(largest))})" if largest != rows else ""))
    else:
        lines.append(f"Not even one row of {plan_.max_length} tokens fits: " + _advice(plan_))
    return "\n".join(lines)


def _advice(plan_: Plan) -> str:
    return ("shard the model (an FSDP or ZeRO-3 accelerate config), use method=qlora, or a card with more memory"
            if plan_.total(0) > plan_.device.capacity else
            "lower train.max_length, turn on train.gradient_checkpointing, or use method=qlora")


def count(parameters: int) -> str:
    """A parameter count in the unit that fits it: 3.21B, 24.3M, 410.2K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if parameters >= size:
            return f"{parameters / size:,.{2 if unit == 'B' else 1}f}{unit}"
    return f"{parameters:,}"
