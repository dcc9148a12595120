"""Hardware profiles: every machine constant the cost model uses, kept in TOML files."""

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..candidates.layout import GIB
from ..errors import Rule, UserError, check_fields, read_input, shown, tomllib

PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator type and its interconnect."""

    name: str
    peak_tflops: float
    """Peak dense throughput in the training dtype, TFLOP/s."""
    memory_gib: float
    """Device memory."""
    usable_memory_fraction: float
    """Fraction of device memory the planner may fill (allocator, context, comm buffers)."""
    gpus_per_node: int
    intra_node_gbps: float
    """Collective bus bandwidth inside a node, GB/s."""
    inter_node_gbps: float
    """Collective bandwidth per device across nodes, GB/s."""
    intra_node_latency_us: float
    inter_node_latency_us: float
    comm_overlap: float
    """Fraction of a layer's compute under which its FSDP collectives can hide (0..1)."""
    matmul_efficiency: float = 1.0
    """Achieved fraction of peak on the model's GEMMs, where the profile has no GEMM table."""
    grouped_mm: bool = True
    """Grouped GEMMs for routed experts (TorchTitan uses them from SM90 on); without them each
    local expert's three GEMMs are separate kernels, forward and backward."""
    kernel_launch_us: float = 5.0
    """Fixed cost of one kernel (launch + tail) when experts run one GEMM each."""
    moe_load_imbalance: float = 1.2
    """MoE routing: tokens on the busiest expert-parallel rank / the mean (1 = perfectly
    balanced). Scales token all-to-all volume and routed-expert compute when ep > 1."""
    host_cores: int = 0
    """CPU cores the ranks of a node share (CPU training); 0 = each rank has its own device.
    More ranks than cores time-share them: every time scales by ranks per node / host_cores."""
    oversubscribed_latency_us: float = 0.0
    """Extra latency per collective step when the ranks of a node outnumber ``host_cores``: a
    rank waits for its peer to be scheduled (about one scheduler time slice)."""
    block_overhead_us: float = 0.0
    """Fixed host time per layer and micro-batch, forward + backward (framework dispatch,
    FSDP hooks); matters where kernels are small (CPU, tiny models)."""
    host_copy_gbps: float = 0.0
    """FSDP2's host copies on the training thread (all-gather copy-in / copy-out, gradient
    reduce-scatter buffers), GB/s of sharded-collective traffic; they do not overlap compute.
    0 = not modelled (GPUs: the copies are device kernels on their own streams)."""
    attention_efficiency: float = 0.0
    """Achieved fraction of peak in the attention kernels (flash / memory-efficient SDPA);
    0 = ``matmul_efficiency``."""
    attention_backward_factor: float = 2.0
    """Attention backward FLOPs / forward FLOPs (flash attention recomputes the scores in
    backward: five matmuls against the forward's two, 2.5)."""
    hbm_gbps: float = 0.0
    """Achieved device-memory bandwidth of streaming kernels (norms, activations, RoPE, casts),
    GB/s; 0 = their time is not modelled (inside ``matmul_efficiency``)."""
    compile_saved_fraction: float = 1.0
    """Activation bytes a compiled block saves for backward / an eager block's, without AC (the
    compiler's partitioner recomputes cheap pointwise results instead of saving them): what a
    block without AC keeps and what a checkpointed block's recomputation materialises. Selective
    AC keeps the same tensors compiled or not. Measured by experiments/compile_saved.py."""
    float8_speedup: float = 1.0
    """float8 GEMM throughput / bf16 on large GEMMs, tensorwise scaling (cuBLAS)."""
    float8_rowwise_speedup: float = 1.0
    """The same for rowwise scaling (CUTLASS rowwise kernels)."""
    float8_full_speed_dim: int = 0
    """GEMMs whose smallest per-rank dimension is below this get proportionally less of the
    float8 speedup (their casts stay): the shape dependence of float8 GEMMs."""
    mx_speedup: float = 1.0
    """MXFP8 GEMM throughput / bf16 on large GEMMs (SM100+)."""
    async_tp_overlap: float = 0.0
    """Fraction of TP all-gathers / reduce-scatters hidden under the neighbouring GEMMs with
    async (micro-pipelined) TP."""
    reserved_gradients: bool = False
    """Memory is the caching allocator's reserve (GPUs): the sharded gradients freed before
    each step's forward stay reserved (their blocks are too small for the activations), so
    the forward/backward peak counts them. False: tensor memory (CPU, MemTracker)."""
    reserved_logits: bool = False
    """Memory is the caching allocator's reserve at the loss too: the log-softmax backward's
    input gradient (fp32) gets a block of its own, since the low-precision logits' freed block
    is too small for it (4 B per logit more). False: tensor memory."""
    recompute_grad_factor: float = 0.0
    """Backward of a fully checkpointed block: activation gradients held beside the
    recomputed activations, per byte of them (0: not modelled)."""
    pcie_gbps: float = 0.0
    """Host <-> device copy bandwidth per device (FSDP CPU offload), GB/s."""
    host_optimizer_gbps: float = 0.0
    """AdamW on the host (CPU offload): GB/s of optimizer state (16 B per parameter) updated."""

    gemm_table: str = ""
    """Measured GEMM throughput by shape (``profiles/kernels/<name>.csv``); "" = GEMMs at
    ``peak_tflops x matmul_efficiency`` (the CPU profile)."""
    clock_scale: float = 1.0
    """Sustained GEMM / attention throughput of this device / the GEMM table's device (clock
    and power limit)."""
    float8_gemm_speedup: float = 1.0
    """Compute-bound float8 (tensorwise, cuBLAS) GEMM throughput / bf16 at the same shape."""
    float8_rowwise_gemm_speedup: float = 1.0
    """The same for rowwise-scaled float8 GEMMs (CUTLASS rowwise kernels)."""
    float8_rowwise_table: str = ""
    """Measured float8 rowwise / bf16 speedup of whole linears (GEMMs and casts) by shape
    (``profiles/kernels/<name>.csv``); "" = ``float8_rowwise_gemm_speedup`` and the casts'
    bytes."""
    attention_fwd_tflops: float = 0.0
    """Flash-attention forward throughput on long sequences (causal FLOPs), TFLOP/s, in the GEMM
    table device's units: the model multiplies it by ``clock_scale`` (a device measured at X
    TFLOP/s with clock_scale c has X / c here)."""
    attention_bwd_tflops: float = 0.0
    """Flash-attention backward throughput (``attention_backward_factor`` x the forward's
    FLOPs), TFLOP/s, in the same units as ``attention_fwd_tflops``."""
    attention_half_seq: float = 0.0
    """Sequence length at which flash attention reaches half its long-sequence throughput."""
    intra_node_half_mib: float = 0.0
    """Message size at which NCCL reaches half of ``intra_node_gbps`` (0: flat bandwidth)."""
    inter_node_half_mib: float = 0.0
    """The same across nodes."""
    nccl_sm_fraction: float = 0.0
    """Fraction of the device's SMs NCCL's kernels hold while a collective overlaps compute."""
    device_names: tuple[str, ...] = ()
    """Substrings of the name CUDA reports for this device (``torch.cuda.get_device_name``):
    how a job on a GPU finds its profile when ``autoparallel.hardware`` is not set."""
    provenance: tuple[tuple[str, str], ...] = ()
    """Where each constant comes from: (field, "datasheet: ..." / "measured: ..." /
    "fitted: ..." / "assumed: ...")."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_names", tuple(self.device_names))
        pairs = self.provenance.items() if isinstance(self.provenance, dict) else self.provenance
        object.__setattr__(self, "provenance", tuple((str(k), str(v)) for k, v in pairs))

    def to_dict(self) -> dict:
        """The profile as plain data (provenance as a field -> source table)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["provenance"] = dict(self.provenance)
        data["device_names"] = list(self.device_names)
        return data

    def source(self, name: str) -> str:
        """Where the constant ``name`` comes from ("" if the profile does not say)."""
        return dict(self.provenance).get(name, "")

    def assumed(self) -> list[str]:
        """The constants the profile marks as assumed."""
        return [k for k, v in self.provenance if v.startswith("assumed")]

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.matmul_efficiency

    @property
    def attention_flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * (self.attention_efficiency or self.matmul_efficiency)

    @property
    def budget_bytes(self) -> float:
        return self.memory_gib * GIB * self.usable_memory_fraction


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_profile(name_or_path: str) -> HardwareProfile:
    """Load a profile by name (``h100_sxm``, ``a100_sxm``, ``cpu``) or from a TOML file path."""
    path = Path(name_or_path)
    if not (name_or_path.endswith(".toml") or os.sep in name_or_path):
        path = PROFILE_DIR / f"{name_or_path}.toml"
    try:
        found, folder = path.is_file(), path.is_dir()
    except OSError:
        found = folder = False
    if folder:
        raise UserError(f"hardware profile {shown(name_or_path)} is a directory: name a profile "
                        f".toml file, or one of {available_profiles()}")
    if not found:
        raise UserError(
            f"unknown hardware profile {shown(name_or_path)}: use one of {available_profiles()} "
            "or a path to a profile .toml"
        )
    raw = read_input(path, "hardware profile", 1 << 20)
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"hardware profile {path} is malformed: {shown(exc, 200)}") from exc
    check_profile_data(data, str(path))
    check_provenance(data, str(path))
    return HardwareProfile(**data)


PROVENANCE_KINDS = ("datasheet", "measured", "fitted", "assumed")


def check_provenance(data: dict, source: str) -> None:
    """Every constant of a profile file says where it comes from in its ``[provenance]``
    table: ``datasheet: ...``, ``measured: ...``, ``fitted: ...`` or ``assumed: ...``. The
    profiles shipped with the package must say it for every field; a user's file may leave
    fields out, which then count as assumed (and ``explain`` lists them)."""
    sources = data.setdefault("provenance", {})
    if not isinstance(sources, dict):
        raise UserError(f"hardware profile {source}: [provenance] must be a table of "
                        "field = \"kind: where it comes from\"")
    shipped = Path(source).resolve().parent == PROFILE_DIR
    for key in sorted(set(data) - {"name", "provenance"}):
        text = sources.get(key)
        if text is None and not shipped:
            sources[key] = f"assumed: {Path(source).name} does not say where it comes from"
            continue
        if not isinstance(text, str) or text.split(":", 1)[0].strip() not in PROVENANCE_KINDS:
            raise UserError(
                f"hardware profile {source}: {key} has no provenance; add "
                f"provenance.{key} = \"datasheet|measured|fitted|assumed: where it comes from\"")


@dataclasses.dataclass(frozen=True)
class Device:
    """What CUDA reports of a job's GPU."""

    name: str
    capability: tuple[int, int]
    memory_gib: float


CPU_PROFILE = "cpu"


OTHER_FORMS = {"pcie", "nvl"}
"""Words of a reported name that make it another board (power, memory, links) than the one a
profile describes, unless the profile's entry names them too."""


def _tokens(name: str) -> set[str]:
    return {t for t in name.lower().replace("-", " ").split() if t}


def _names_device(entry: str, reported: str) -> bool:
    """Every word of ``entry`` is in the reported name, and the name adds no other form."""
    want, got = _tokens(entry), _tokens(reported)
    return want <= got and not (got - want) & OTHER_FORMS


def profile_for_device(device: Device | None) -> str:
    """The shipped profile of ``device`` (``cpu`` without a GPU): among the profiles whose
    ``device_names`` occur in the reported name, the one whose memory is closest. A GPU no
    profile names stops the job in one line."""
    if device is None:
        return CPU_PROFILE
    matches = [p for p in (load_profile(n) for n in available_profiles())
               if any(_names_device(entry, device.name) for entry in p.device_names)]
    if not matches:
        gpus = [n for n in available_profiles() if n != CPU_PROFILE]
        raise UserError(
            f"no hardware profile matches this GPU ({shown(device.name, 80)}, "
            f"SM{device.capability[0]}{device.capability[1]}, {device.memory_gib:.1f} GiB): "
            f"set autoparallel.hardware to one of {gpus} or to a profile .toml "
            "(python -m torchtitan_autoparallel calibrate writes one)")
    return min(matches, key=lambda p: abs(p.memory_gib - device.memory_gib)).name
# ---------------------------------------------------------------------------------------------
# hardware profiles

TFLOPS_MAX = 1e5
"""TFLOP/s: 100 PFLOP/s, past any one device; larger values are in the wrong unit."""
GBPS_MAX = 1e5
"""GB/s: 100 TB/s, past any link or memory; a value in bytes/s or bits/s lands above it."""
US_MAX = 1e6
"""Microseconds: one second per launch or hop is a unit mistake."""

PROFILE_RULES: dict[str, Rule] = {
    "name": Rule(str),
    "peak_tflops": Rule(float, ge=1e-3, le=TFLOPS_MAX),
    "matmul_efficiency": Rule(float, ge=1e-3, le=1),
    "memory_gib": Rule(float, ge=1e-2, le=1e4),
    "usable_memory_fraction": Rule(float, ge=1e-2, le=1),
    "gpus_per_node": Rule(int, ge=1, le=1024),
    "intra_node_gbps": Rule(float, ge=1e-3, le=GBPS_MAX),
    "inter_node_gbps": Rule(float, ge=1e-3, le=GBPS_MAX),
    "intra_node_latency_us": Rule(float, ge=0, le=US_MAX),
    "inter_node_latency_us": Rule(float, ge=0, le=US_MAX),
    "comm_overlap": Rule(float, ge=0, le=1),
    "grouped_mm": Rule(bool),
    "kernel_launch_us": Rule(float, ge=0, le=US_MAX),
    "moe_load_imbalance": Rule(float, ge=1, le=1e3),
    "host_cores": Rule(int, ge=0, le=1e5),
    "oversubscribed_latency_us": Rule(float, ge=0, le=US_MAX),
    "block_overhead_us": Rule(float, ge=0, le=US_MAX),
    "host_copy_gbps": Rule(float, ge=0, le=GBPS_MAX),
    "attention_efficiency": Rule(float, ge=0, le=1),
    "attention_backward_factor": Rule(float, ge=0.1, le=10),
    "hbm_gbps": Rule(float, ge=0, le=GBPS_MAX),
    "compile_saved_fraction": Rule(float, ge=1e-2, le=1),
    "float8_speedup": Rule(float, ge=0.1, le=4),
    "float8_rowwise_speedup": Rule(float, ge=0.1, le=4),
    "float8_full_speed_dim": Rule(int, ge=0),
    "mx_speedup": Rule(float, ge=0.1, le=8),
    "async_tp_overlap": Rule(float, ge=0, le=1),
    "reserved_gradients": Rule(bool),
    "reserved_logits": Rule(bool),
    "recompute_grad_factor": Rule(float, ge=0, le=10),
    "pcie_gbps": Rule(float, ge=0, le=GBPS_MAX),
    "host_optimizer_gbps": Rule(float, ge=0, le=GBPS_MAX),
    "gemm_table": Rule(str),
    "clock_scale": Rule(float, ge=1e-2, le=2),
    "float8_gemm_speedup": Rule(float, ge=0.1, le=4),
    "float8_rowwise_gemm_speedup": Rule(float, ge=0.1, le=4),
    "float8_rowwise_table": Rule(str),
    "attention_fwd_tflops": Rule(float, ge=0, le=TFLOPS_MAX),
    "attention_bwd_tflops": Rule(float, ge=0, le=TFLOPS_MAX),
    "attention_half_seq": Rule(float, ge=0),
    "intra_node_half_mib": Rule(float, ge=0),
    "inter_node_half_mib": Rule(float, ge=0),
    "nccl_sm_fraction": Rule(float, ge=0, le=0.9),
    "provenance": Rule(dict),
    "device_names": Rule(list, item=str),
}
"""Hardware profile fields. Fields without a row: finite and >= 0."""


def check_profile_data(data: Mapping[str, Any], source: str) -> None:
    """A profile TOML's keys and values, before the profile is built."""
    missing = [f.name for f in dataclasses.fields(HardwareProfile)
               if f.default is dataclasses.MISSING and f.name not in data]
    if missing:
        raise UserError(f"hardware profile {source}: missing key {missing[0]!r}; add it (see "
                        "torchtitan_autoparallel/profiles/*.toml)")
    check_fields(f"hardware profile {source}: ", data, HardwareProfile, PROFILE_RULES,
                 "fix the profile file (units: TFLOP/s, GB/s, GiB, microseconds)")
