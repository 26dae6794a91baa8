"""The runtime layer: an exported model opened in onnxruntime or OpenVINO on the CPU, in
fp32, bf16 or INT8. numpy only at import; no PyTorch, no OpenMMLab (the predictor runs
without them).

One way to open a model (:func:`open_model`, :func:`load_runtime_model` for an export
directory), with the same options for every caller (the predictor, ``tools/test.py
--backend`` through ``RuntimeBackendHook``, ``tools/export_onnx.py``'s parity check and the
benchmarks):

* onnxruntime (:func:`ort_session_options`): CPU execution provider, every graph
  optimization (``ORT_ENABLE_ALL``), ``threads`` intra-op threads and one inter-op thread
  (0: onnxruntime's defaults), worker threads that stop spinning when a run returns
  (:data:`ORT_SPIN_STOP`);
* OpenVINO (:func:`openvino_config`): ``Core.read_model`` then ``compile_model`` on the CPU
  with the latency hint, ``INFERENCE_PRECISION_HINT`` ``f32`` (on CPUs with bf16 units
  OpenVINO otherwise computes in bf16) or ``bf16``, ``threads`` inference threads.

A :class:`RuntimeModel` returns every output in graph order (``model(image)``) or the
outputs asked for by name (``model.run(image, names)``).

Precisions (:data:`PRECISIONS`, one resolver: :func:`resolve_precision`): ``fp32`` runs the
fp32 artifact in fp32 arithmetic; ``int8`` the INT8 artifact; ``bf16`` (OpenVINO only, CPUs
with avx512_bf16 / amx_bf16) the fp32 artifact with OpenVINO's
``INFERENCE_PRECISION_HINT=bf16``. onnxruntime has no bf16 path on x86 CPUs
(:data:`ORT_NO_BF16`).

Which runtime and precision an export directory runs in by default
(:func:`choose_runtime_form`): the deployed form ``export.json`` records
(``latency.deploy``, :func:`choose_deployment` at export) where the caller names neither,
onnxruntime fp32 where nothing is recorded; what the caller names wins.

Writing the artifacts is the export side: ``tools/export_onnx.py`` with
:func:`convert_to_openvino` (the IR of the ONNX file) and :mod:`mmslab.deploy.quantize`
(calibration and INT8, which need the model).
"""
import importlib
import importlib.util
import os
import os.path as osp
import warnings
from collections import OrderedDict
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .export_info import EXPORT_HINT, EXPORT_JSON, deployed_form

RUNTIMES = ('onnxruntime', 'openvino')
PRECISIONS = ('fp32', 'bf16', 'int8')
#: What each runtime computes in (onnxruntime: no bf16 on x86 CPUs, :data:`ORT_NO_BF16`).
RUNTIME_PRECISIONS = dict(onnxruntime=('fp32', 'int8'), openvino=PRECISIONS)

#: Why onnxruntime refuses bf16 (measured with onnxruntime 1.32 on a CPU with AMX bf16 units;
#: ``benchmarks/ort_bf16_probe.py`` repeats the measurement on the machine at hand).
ORT_NO_BF16 = ('onnxruntime has no bf16 compute on x86 CPUs: its CPU execution provider has no '
               'bf16 MatMul / Conv kernels (a graph with bf16 MatMuls fails to load: '
               'NOT_IMPLEMENTED), its only bf16 option, mlas.enable_gemm_fastmath_arm64_bfloat16, '
               'is for ARM64 CPUs, and fp16 MatMuls are no faster than fp32. Use OpenVINO bf16, '
               'eager PyTorch bf16, or onnxruntime fp32 / int8')

#: The packages of the optional extra 'openvino' -> their names in messages.
OPENVINO_EXTRA = dict(openvino='OpenVINO', nncf='NNCF')


def import_openvino(module: str = 'openvino'):
    """``module`` of the optional extra 'openvino' (``openvino`` or ``nncf``), or an
    ImportError that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f'{OPENVINO_EXTRA[module]} is not installed: OpenVINO and NNCF are the optional '
            "extra 'openvino' (tools/install_deps.sh installs them unless MMSLAB_OPENVINO=0; "
            "or: pip install 'openvino>=2025.0' 'nncf>=2.16'). Without them use "
            '--backend onnxruntime') from e


# ----------------------------------------------------------------------------------------------
# precision
# ----------------------------------------------------------------------------------------------

def check_runtime(runtime: str) -> str:
    if runtime not in RUNTIMES:
        raise ValueError(f'unknown runtime {runtime!r}; valid: {", ".join(RUNTIMES)}')
    return runtime


def resolve_precision(precision: Optional[str] = None, int8: bool = False, bf16: bool = False,
                      runtime: Optional[str] = None, auto: bool = False) -> str:
    """The one precision that ``precision`` and its short forms ``int8=True`` /
    ``bf16=True`` (``--int8`` / ``--bf16`` on the command lines) name, checked against what
    ``runtime`` computes (:data:`RUNTIME_PRECISIONS`) when one is given.

    Returns 'fp32' when nothing is given, else 'bf16', 'int8' or, with ``auto=True``
    (``tools/test.py``, ``RuntimeBackendHook``), 'auto'. Raises ``ValueError`` naming what is
    valid for an unknown precision, both short forms, a short form that contradicts
    ``precision``, and a precision the runtime does not compute. Whether this CPU has bf16
    units is checked where OpenVINO bf16 opens (:class:`OpenVINOModel`).
    """
    choices = PRECISIONS + (('auto', ) if auto else ())
    if precision is not None and precision not in choices:
        raise ValueError(f'unknown precision {precision!r}; valid: {", ".join(choices)}')
    if int8 and bf16:
        raise ValueError('int8 and bf16 exclude each other (--int8, --bf16: one --precision): '
                         'INT8 is its own precision (an exported artifact), bf16 rounds the '
                         "fp32 model's arithmetic")
    short = 'int8' if int8 else 'bf16' if bf16 else None
    if short is not None and precision not in (None, short):
        raise ValueError(f'--{short} ({short}=True) is short for --precision {short}; it '
                         f'contradicts --precision {precision}')
    precision = precision or short or 'fp32'
    if runtime is not None:
        valid = RUNTIME_PRECISIONS[check_runtime(runtime)] + (('auto', ) if auto else ())
        if precision not in valid:  # bf16 in onnxruntime
            raise ValueError('bf16 runs the fp32 export in OpenVINO (INFERENCE_PRECISION_HINT); '
                             f'{ORT_NO_BF16}. Valid with {runtime}: {", ".join(valid)}')
    return precision


#: How much faster a less exact precision (bf16 after fp32, INT8 after both) must run to be
#: deployed instead: a smaller difference is within what repeated timings of one model vary.
DEPLOY_MIN_SPEEDUP = 1.05


def choose_deployment(median_ms: dict, min_speedup: float = DEPLOY_MIN_SPEEDUP) -> dict:
    """The exported form to deploy, from measured latencies ``{'RUNTIME PRECISION': ms}``
    (``tools/export_onnx.py --latency``; other keys such as ``eager fp32`` are ignored).

    The fastest fp32 form first; the fastest bf16 form replaces it only if it is at least
    ``min_speedup`` times faster, then the fastest INT8 form likewise: a less exact form must
    pay for what it changes. The same times give the same choice.

    Returns ``runtime``, ``precision``, ``median_ms`` and ``reason`` (one sentence with the
    figures compared). Raises ``ValueError`` when no runtime form was timed.
    """
    best = {}
    for key, ms in median_ms.items():
        runtime, _, precision = key.partition(' ')
        if runtime in RUNTIMES and precision in RUNTIME_PRECISIONS[runtime]:
            if precision not in best or ms < best[precision][2]:
                best[precision] = (runtime, precision, ms)
    if not best:
        raise ValueError(f'no runtime form among the timed {sorted(median_ms)}; valid: '
                         f'"RUNTIME PRECISION" with RUNTIME in {", ".join(RUNTIMES)}')
    chosen, steps = None, []
    for precision in PRECISIONS:  # most exact first
        if precision not in best:
            continue
        runtime, _, ms = candidate = best[precision]
        if chosen is None:
            chosen = candidate
            steps.append(f'{runtime} {precision} {ms:.0f} ms is the fastest {precision} form')
            continue
        gain = chosen[2] / ms
        verdict = 'deployed' if gain >= min_speedup else 'not deployed'
        steps.append(f'{runtime} {precision} {ms:.0f} ms runs {gain:.2f}x as fast as '
                     f'{chosen[0]} {chosen[1]} ({verdict}: the bar is {min_speedup:.2f}x)')
        if gain >= min_speedup:
            chosen = candidate
    runtime, precision, ms = chosen
    return dict(runtime=runtime, precision=precision, median_ms=ms, reason='; '.join(steps))


def artifact_path(export_dir: str, runtime: str, precision: str) -> str:
    """Where ``tools/export_onnx.py`` writes the artifact ``runtime`` runs at ``precision``
    (only 'int8' has its own; 'bf16' computes the fp32 one in bf16)."""
    check_runtime(runtime)
    if precision not in PRECISIONS:
        raise ValueError(f'unknown precision {precision!r}; valid: {", ".join(PRECISIONS)}')
    int8 = precision == 'int8'
    if runtime == 'onnxruntime':
        return osp.join(export_dir, 'model_int8.onnx' if int8 else 'model.onnx')
    return osp.join(export_dir, 'openvino', 'model_int8.xml' if int8 else 'model.xml')


# ----------------------------------------------------------------------------------------------
# the form an export directory runs in
# ----------------------------------------------------------------------------------------------

class RuntimeForm(NamedTuple):
    """The runtime and precision chosen for an export directory (:func:`choose_runtime_form`).

    ``source``: ``'export.json'`` (the deployed form it records), ``'fallback'`` (that form
    cannot run here, ``note`` says why and what runs instead), ``'command line'`` (the
    caller's runtime / precision) or ``'default'`` (nothing recorded, nothing named:
    onnxruntime fp32). ``deployed``: the recorded form (``runtime``, ``precision``,
    ``shape``), None where the export was not timed. ``note``: the line a tool prints about
    the choice (None where the caller named the form and nothing is recorded).
    """
    runtime: str
    precision: str
    source: str
    deployed: Optional[dict]
    note: Optional[str]


def form_problem(export_dir: str, runtime: str, precision: str) -> Optional[str]:
    """Why ``runtime`` at ``precision`` cannot run ``export_dir``'s model on this machine
    (runtime not installed, no bf16 units, artifact missing), or None."""
    if runtime == 'openvino' and importlib.util.find_spec('openvino') is None:
        return 'OpenVINO is not installed here'
    if precision == 'bf16':
        from mmslab.utils.machine import has_bf16  # torch-free: /proc/cpuinfo flags
        if not has_bf16():
            return 'this CPU has neither avx512_bf16 nor amx_bf16'
    path = artifact_path(export_dir, runtime, 'fp32' if precision == 'auto' else precision)
    if not osp.isfile(path):
        return f'{path} does not exist' + (' (exported without --int8)'
                                           if precision == 'int8' else '')
    return None


def choose_runtime_form(export_dir: str, info: Optional[dict], runtime: Optional[str] = None,
                        precision: Optional[str] = None,
                        flags: Tuple[str, str] = ('--runtime', '--precision'),
                        require_deployed: bool = False, auto: bool = False) -> RuntimeForm:
    """The runtime and precision ``export_dir`` runs in: the deployed form its
    ``export.json`` records (``info``, read by the caller: :func:`deployed_form`) for what the
    caller leaves None, else what the caller names.

    * ``runtime`` None: the deployed runtime (onnxruntime where none is recorded);
    * ``precision`` None: the deployed precision where the runtime is the deployed one, else
      fp32;
    * where the recorded form decided and cannot run here (:func:`form_problem`: its INT8
      artifact missing, OpenVINO not installed, bf16 without bf16 units), the same runtime in
      fp32, then onnxruntime, whichever can; ``note`` says so.

    Args:
        export_dir: the export directory (its artifacts are checked).
        info: its ``export.json`` (None: unreadable; nothing recorded).
        runtime, precision: what the caller names (None: not named). ``precision`` is one
            precision, the short forms ``--int8`` / ``--bf16`` resolved
            (:func:`resolve_precision`).
        flags: the caller's option names for runtime and precision, for ``note``.
        require_deployed: refuse (``ValueError``) an export that records no deployed form.
        auto: allow precision ``'auto'`` (``tools/test.py``).

    Returns:
        RuntimeForm: ``note`` is the line to print.
    """
    deployed = deployed_form(info, osp.join(export_dir, EXPORT_JSON)) if info else None
    choose = '/'.join(flags) + ' choose another'
    named = [f for f, value in zip(flags, (runtime, precision)) if value is not None]
    if runtime is not None:
        check_runtime(runtime)
    if deployed is None:
        if require_deployed:
            raise ValueError(
                f'{osp.join(export_dir, EXPORT_JSON)} records no deployed form (latency.deploy, '
                f'written by {EXPORT_HINT.format(dir=export_dir)} --latency HxW); name the '
                f'runtime instead: {flags[0]} {" or ".join(RUNTIMES)}')
        runtime = runtime or 'onnxruntime'
        precision = resolve_precision(precision, runtime=runtime, auto=auto)
        note = None if named else (
            f'{EXPORT_JSON} records no deployed form (tools/export_onnx.py --latency HxW '
            f'measures one): running {runtime} {precision}; {choose}')
        return RuntimeForm(runtime, precision, 'command line' if named else 'default', None,
                           note)

    rec = f"{deployed['runtime']} {deployed['precision']}"
    why = f"chosen by tools/export_onnx.py --latency {deployed['shape']}"
    runtime_recorded, precision_recorded = runtime is None, False
    runtime = runtime or deployed['runtime']
    if precision is None:
        precision_recorded = runtime == deployed['runtime']
        precision = deployed['precision'] if precision_recorded else 'fp32'
    try:
        precision = resolve_precision(precision, runtime=runtime, auto=auto)
    except ValueError as err:
        if runtime_recorded:  # the caller named the precision only
            raise ValueError(f'{runtime} is the deployed runtime {EXPORT_JSON} records ({rec}): '
                             f'{err}') from None
        raise

    problem = form_problem(export_dir, runtime, precision) \
        if runtime_recorded or precision_recorded else None
    if problem is not None:
        candidates = []
        if precision_recorded and precision != 'fp32':
            candidates.append((runtime, 'fp32'))
        if runtime_recorded and runtime != 'onnxruntime':
            other = 'fp32' if precision_recorded else precision
            if other in RUNTIME_PRECISIONS['onnxruntime'] + (('auto', ) if auto else ()):
                candidates.append(('onnxruntime', other))
        usable = [c for c in candidates if form_problem(export_dir, *c) is None]
        if usable:  # else the chosen form stays, and opening it says what is missing
            runtime, precision = usable[0]
            return RuntimeForm(
                runtime, precision, 'fallback', deployed,
                f'deployed form from {EXPORT_JSON}: {rec} ({why}), but {problem}: running '
                f'{runtime} {precision} instead; {choose}')

    if (runtime, precision) == (deployed['runtime'], deployed['precision']):
        return RuntimeForm(runtime, precision, 'export.json', deployed,
                           f'deployed form from {EXPORT_JSON}: {rec} ({why}); {choose}')
    return RuntimeForm(
        runtime, precision, 'command line', deployed,
        f'running {runtime} {precision} as {" and ".join(named)} '
        f'{"say" if len(named) > 1 else "says"}; the deployed form in {EXPORT_JSON} is {rec} '
        f'({why})')


# ----------------------------------------------------------------------------------------------
# sessions
# ----------------------------------------------------------------------------------------------

#: onnxruntime's worker threads spin for work between a session's runs unless told to stop
#: when a run returns. A spinning worker holds a core while whatever comes next runs: another
#: session's run, PyTorch, OpenVINO, a pipeline's pre- and post-processing. With the spinning
#: on, a run right after another session's is markedly slower than one right after its own;
#: stopped, both are as fast as the latter (docs/benchmarks.md). Runs back to back are as fast
#: either way (the spinning restarts with the next run).
ORT_SPIN_STOP = ('session.force_spinning_stop', '1')


def ort_session_options(threads: int = 0):
    """The ``onnxruntime.SessionOptions`` of every session (``threads`` 0: its defaults)."""
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.add_session_config_entry(*ORT_SPIN_STOP)
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    return opts


def openvino_config(threads: int = 0, bf16: bool = False) -> dict:
    """The CPU ``compile_model`` configuration of every OpenVINO model."""
    # fp32 means fp32: on CPUs with bf16 units OpenVINO otherwise computes in bf16.
    config = {'PERFORMANCE_HINT': 'LATENCY', 'INFERENCE_PRECISION_HINT': 'bf16' if bf16 else 'f32'}
    if threads:
        config['INFERENCE_NUM_THREADS'] = threads
    return config


def _one_input(path: str, count: int) -> None:
    if count != 1:
        raise ValueError(f'{path} has {count} inputs; expected one image input')


class RuntimeModel:
    """An exported model in a runtime on the CPU.

    ``model(image)``: ``image`` ``[1, 3, H, W]`` float32 -> every output, in graph order;
    ``model.run(image, names)`` -> ``{name: array}`` of the outputs named. Attributes:
    ``runtime``, ``path``, ``threads``, ``precision`` ('fp32', 'bf16' or 'int8'),
    ``input_hw`` (the input's static height and width, None where free) and
    ``output_names`` (every name an output answers to).
    """

    precision = 'fp32'
    input_hw: Tuple[Optional[int], Optional[int]] = (None, None)
    output_names: List[str] = []

    def __init__(self, runtime: str, path: str, threads: int):
        self.runtime, self.path, self.threads = runtime, path, threads

    def __call__(self, image: np.ndarray) -> List[np.ndarray]:
        raise NotImplementedError

    def run(self, image: np.ndarray, names: Sequence[str]) -> Dict[str, np.ndarray]:
        raise NotImplementedError


#: The ONNX metadata key of an onnxruntime INT8 file's weight bits (``quantize_onnxruntime``).
INT8_WEIGHT_BITS_KEY = 'mmslab_int8_weight_bits'


def int8_weight_bits() -> int:
    """The bits of onnxruntime INT8 weights this CPU computes exactly: 8 with 8-bit dot
    products (VNNI, AMX), 7 without (see :func:`~.quantize.quantize_onnxruntime`)."""
    from mmslab.utils.machine import has_int8_dot_product  # torch-free
    return 8 if has_int8_dot_product() else 7


class OnnxRuntimeModel(RuntimeModel):
    """An ONNX file in onnxruntime's CPU session. Warns when an INT8 file quantized with
    8-bit weights runs on a CPU that computes 7-bit ones exactly (:func:`int8_weight_bits`):
    its products saturate there."""

    def __init__(self, path: str, threads: int = 0):
        import onnxruntime as ort
        super().__init__('onnxruntime', path, threads)
        self.session = ort.InferenceSession(path, ort_session_options(threads),
                                            providers=['CPUExecutionProvider'])
        inputs = self.session.get_inputs()
        _one_input(path, len(inputs))
        self.input_name = inputs[0].name
        shape = inputs[0].shape or [None] * 4
        self.input_hw = tuple(d if isinstance(d, int) else None for d in shape[-2:])
        self.output_names = [o.name for o in self.session.get_outputs()]
        bits = self.session.get_modelmeta().custom_metadata_map.get(INT8_WEIGHT_BITS_KEY)
        if bits is not None and int(bits) > int8_weight_bits():
            warnings.warn(f'{path}: INT8 with {bits}-bit weights on a CPU without 8-bit dot '
                          f'products (VNNI, AMX), whose onnxruntime kernels saturate on them: '
                          f'outputs far off. Quantize again on this machine (7-bit weights: '
                          f'tools/export_onnx.py --int8).')

    def _run(self, names: Optional[List[str]], image: np.ndarray) -> List[np.ndarray]:
        return self.session.run(names, {self.input_name: np.ascontiguousarray(image)})

    def __call__(self, image: np.ndarray) -> List[np.ndarray]:
        return self._run(None, image)

    def run(self, image: np.ndarray, names: Sequence[str]) -> Dict[str, np.ndarray]:
        return dict(zip(names, self._run(list(names), image)))


#: How many input sizes an OpenVINO model of free size keeps compiled for (see
#: :class:`OpenVINOModel`).
OPENVINO_SIZES_KEPT = 4


class OpenVINOModel(RuntimeModel):
    """``bf16``: OpenVINO computes the float parts in bf16 (``INFERENCE_PRECISION_HINT``);
    refused on CPUs without bf16 units. INT8 models keep their int8 layers either way.

    ``sizes_kept``: a model exported for any input size is compiled again for each input
    shape it meets, the ``sizes_kept`` most recently used kept (0: run the free-size model
    as it is). OpenVINO's CPU plugin fuses far less in a graph of free size (element-wise
    chains, layout transposes around convolutions), so a backbone runs slower free than
    fixed. A new shape costs one compile; images resized to a fixed scale and padded to a
    multiple of 32 come in a few shapes. ``compiles`` counts them.
    """

    def __init__(self, path: str, threads: int = 0, bf16: bool = False,
                 sizes_kept: int = OPENVINO_SIZES_KEPT):
        if bf16:
            from mmslab.utils.machine import require_bf16  # torch-free: /proc/cpuinfo flags
            require_bf16('OpenVINO bf16')
        if sizes_kept < 0:
            raise ValueError(f'sizes_kept={sizes_kept}: must be >= 0 (0: no shape-fixed '
                             f'compiles)')
        ov = import_openvino()
        super().__init__('openvino', path, threads)
        self._core = ov.Core()
        self._config = openvino_config(threads, bf16)
        self._model = self._core.read_model(path)
        _one_input(path, len(self._model.inputs))
        dims = list(self._model.input(0).get_partial_shape())
        self.input_hw = tuple(d.get_length() if d.is_static else None for d in dims[-2:])
        self.output_names = sorted({n for o in self._model.outputs for n in o.get_names()})
        self.precision = 'bf16' if bf16 else 'fp32'
        self.sizes_kept = 0 if all(d.is_static for d in dims) else sizes_kept
        self.compiles = 0
        self._fixed = OrderedDict()  # input shape -> (compiled model, infer request)
        self._free = None  # (compiled, request) of the model as read, compiled when used

    def _for_shape(self, shape: Tuple[int, ...]):
        """``(compiled, request)`` for an input of ``shape``: a copy of the model compiled
        for that shape (kept, most recently used last), or the model as read (compiled
        once, only where it runs: a compiled copy holds its own weights)."""
        if not self.sizes_kept:
            if self._free is None:
                compiled = self._core.compile_model(self._model, 'CPU', self._config)
                self._free = (compiled, compiled.create_infer_request())
            return self._free
        hit = self._fixed.get(shape)
        if hit is not None:
            self._fixed.move_to_end(shape)
            return hit
        model = self._model.clone()
        model.reshape({model.input(0).any_name: list(shape)})
        compiled = self._core.compile_model(model, 'CPU', self._config)
        self.compiles += 1
        self._fixed[shape] = hit = (compiled, compiled.create_infer_request())
        while len(self._fixed) > self.sizes_kept:
            self._fixed.popitem(last=False)
        return hit

    def _infer(self, image: np.ndarray):
        image = np.ascontiguousarray(image)
        compiled, request = self._for_shape(tuple(image.shape))
        request.infer({0: image})
        return compiled, request

    def __call__(self, image: np.ndarray) -> List[np.ndarray]:
        compiled, request = self._infer(image)
        # copies: the request reuses its output buffers on the next call
        return [request.get_output_tensor(i).data.copy() for i in range(len(compiled.outputs))]

    def run(self, image: np.ndarray, names: Sequence[str]) -> Dict[str, np.ndarray]:
        compiled, request = self._infer(image)
        return {n: request.get_tensor(compiled.output(n)).data.copy() for n in names}


def open_model(path: str, runtime: str, precision: str = 'fp32', threads: int = 0,
               sizes_kept: int = OPENVINO_SIZES_KEPT) -> RuntimeModel:
    """The model file ``path`` opened in ``runtime`` at ``precision`` (``'int8'``: ``path``
    is an INT8 artifact; ``'bf16'``: OpenVINO computes the fp32 file in bf16).
    ``sizes_kept``: OpenVINO's shape-fixed compiles of a free-size model
    (:class:`OpenVINOModel`)."""
    precision = resolve_precision(precision, runtime=runtime)
    if runtime == 'onnxruntime':
        model = OnnxRuntimeModel(path, threads)
    else:
        model = OpenVINOModel(path, threads, bf16=precision == 'bf16', sizes_kept=sizes_kept)
    model.precision = precision
    return model


def load_runtime_model(export_dir: str, runtime: str, precision: str = 'fp32',
                       threads: int = 0) -> RuntimeModel:
    """The model of the export directory ``export_dir`` in ``runtime`` at ``precision``
    (:func:`resolve_precision`); ``FileNotFoundError`` names the export command that writes
    a missing artifact."""
    precision = resolve_precision(precision, runtime=runtime)
    path = artifact_path(export_dir, runtime, precision)
    if not osp.isfile(path):
        int8 = precision == 'int8'
        raise FileNotFoundError(
            f"no {'INT8 ' if int8 else ''}{runtime} model at {path}; write it with "
            + EXPORT_HINT.format(dir=export_dir) + f' --runtime {runtime}'
            + (' --int8' if int8 else ''))
    return open_model(path, runtime, precision, threads)


def convert_to_openvino(onnx_path: str, out_dir: str) -> str:
    """The OpenVINO IR (``model.xml`` + ``.bin``) of an ONNX file, fp32 weights."""
    ov = import_openvino()
    os.makedirs(out_dir, exist_ok=True)
    xml = osp.join(out_dir, 'model.xml')
    ov.save_model(ov.convert_model(onnx_path), xml, compress_to_fp16=False)
    return xml


def pad_to_shape(image: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """``[1, 3, h, w]`` zero-padded at the bottom/right to a static export's ``shape``, as
    inference pads it (an image larger than ``shape`` cannot run in that export)."""
    h, w = image.shape[-2:]
    eh, ew = shape
    if h > eh or w > ew:
        raise ValueError(f'input of {h}x{w} (after the data preprocessor) is larger than the '
                         f'exported static shape {eh}x{ew}: export with --dynamic, or with '
                         '--shape H W at least as large as the images')
    return np.pad(image, ((0, 0), (0, 0), (0, eh - h), (0, ew - w)))
