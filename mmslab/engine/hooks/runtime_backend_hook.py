"""Evaluate with the exported model (or part) running in onnxruntime or OpenVINO.

``tools/export_onnx.py`` writes the fused model, or one part of it, to ONNX / OpenVINO, fp32
and INT8. :class:`RuntimeBackendHook` makes the test loop run that artifact: before the
epoch it replaces, on the model instance the loop calls, the method that computes the
exported part with one that runs the runtime image by image:

* part ``model`` of a detector: ``predict`` itself. Only data loading and the data
  preprocessor stay in Python; the runtime's ``dets`` are mapped to the original image
  (``/ scale_factor``, as mmdet rescales) and its RoI masks pasted there with mmdet's own
  pasting, so the metrics are those of the deployed detector;
* part ``model`` of a segmentor: ``encode_decode`` (the logits; mmseg's resize to the
  original image follows);
* ``features`` / ``backbone``: ``extract_feat``, with the heads in PyTorch.

Static exports get each preprocessed image zero-padded at the bottom/right to the exported
size; dynamic exports take it as it is.

The methods are restored however the test ends: after the epoch, and, under
``runner.test()``, in a ``finally`` around the test loop (an exception in a step, in the
evaluator or in another hook included). :meth:`RuntimeBackendHook.runs_in_runtime` is the
same swap as a context manager, for code that drives a model without a runner.
"""
import math
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.runner import BaseLoop

from mmslab.deploy.export_info import (ExportInfoError, deployed_form, is_detector,
                                       is_segmentor, read_export_info)
from mmslab.registry import register_hook


def paste_roi_masks(masks: torch.Tensor, boxes: torch.Tensor, img_h: int, img_w: int,
                    threshold: float) -> torch.Tensor:
    """``[N, 28, 28]`` RoI mask probabilities -> ``[N, img_h, img_w]`` bool masks at
    ``boxes`` (original-image pixels), pasted one by one as mmdet's ``FCNMaskHead`` does on
    the CPU."""
    from mmdet.models.roi_heads.mask_heads.fcn_mask_head import _do_paste_mask
    out = torch.zeros(len(masks), img_h, img_w, dtype=torch.bool)
    for i in range(len(masks)):
        chunk, spatial = _do_paste_mask(masks[i:i + 1, None], boxes[i:i + 1], img_h, img_w,
                                        skip_empty=True)
        out[(torch.tensor([i]), ) + spatial] = chunk >= threshold
    return out


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose methods the loop ends up calling (DDP wrappers, TTA models)."""
    from mmengine.model import BaseTTAModel
    while True:
        if is_model_wrapper(model) or isinstance(model, BaseTTAModel):
            model = model.module
        else:
            return model


def _crop_size(size: int, export_size: int, out_size: int) -> int:
    """Rows (columns) of an output map computed from ``size`` input rows, given that the
    export's ``export_size`` rows gave ``out_size``: ``ceil(size / stride)`` for the power-of-2
    stride that explains the export's own output (every conv / patch-embedding / pooling step
    of these backbones and FPN's extra levels rounds up). Not well-defined (no such stride):
    keep ``out_size``."""
    if out_size <= 0:
        return out_size
    stride = 2 ** round(math.log2(export_size / out_size))
    if stride < 1 or math.ceil(export_size / stride) != out_size:
        return out_size
    return min(out_size, math.ceil(size / stride))


class RuntimePart:
    """``__call__(inputs [N, 3, h, w] tensor) -> list of [N, C, h', w'] tensors``: each image
    zero-padded at the bottom/right to the export's static shape, run, outputs cropped back."""

    def __init__(self, runtime_model, shape: Optional[Sequence[int]]):
        self.runtime_model = runtime_model
        self.shape = tuple(shape) if shape is not None else None  # None: dynamic export

    def _input(self, image: torch.Tensor) -> np.ndarray:
        """``[1, 3, h, w]`` as the runtime takes it: zero-padded to a static export's shape
        (an image larger than it is an error)."""
        image = image.detach().float().cpu().numpy()
        if self.shape is None:
            return image
        from mmslab.deploy.runtimes import pad_to_shape
        try:
            return pad_to_shape(image, self.shape)
        except ValueError as err:
            raise RuntimeError(str(err)) from None

    def whole(self, image: torch.Tensor, names: Sequence[str]) -> Dict[str, torch.Tensor]:
        """One ``[1, 3, h, w]`` image through a whole-model export: the outputs ``names``,
        as they come (detections are in the input's pixels, so zero padding at the
        bottom/right of a static export leaves them where they are)."""
        outputs = self.runtime_model.run(self._input(image), names)
        return {n: torch.from_numpy(np.asarray(o)) for n, o in outputs.items()}

    def __call__(self, inputs: torch.Tensor) -> List[torch.Tensor]:
        h, w = inputs.shape[-2:]
        per_image = [self.runtime_model(self._input(image[None])) for image in inputs]
        padded = self.shape is not None and (h, w) != self.shape
        outs = []
        for i in range(len(per_image[0])):
            out = torch.from_numpy(np.concatenate([o[i] for o in per_image], axis=0))
            if padded and out.dim() == 4:
                # Crop each map to what the PyTorch model gives for this input, so anchors,
                # RoI feature grids and the segmentor's logits keep the layout of the PyTorch
                # run (keeping the padded maps would also be safe for detectors, as mmdet
                # clips boxes to img_shape, but would add anchors/proposals in the padding
                # and change NMS). Values near the bottom/right border still see the zero
                # padding through the receptive field (and global pooling / attention):
                # inherent to a static export; export at the test size to avoid it.
                (eh, ew), (oh, ow) = self.shape, out.shape[-2:]
                out = out[..., :_crop_size(h, eh, oh), :_crop_size(w, ew, ow)]
            outs.append(out.to(inputs.device).contiguous())
        return outs


@register_hook()
class RuntimeBackendHook(Hook):
    """Run the exported part of the model in onnxruntime / OpenVINO during testing.

    Args:
        export_dir (str): the directory written by ``tools/export_onnx.py``
            (``export.json`` tells the part and the static input shape).
        runtime (str): 'onnxruntime' or 'openvino'. Default: 'onnxruntime'.
        int8 (bool): run the INT8 artifact (``model_int8.onnx`` /
            ``openvino/model_int8.xml``); the same as ``precision='int8'``. Default: False.
        threads (int): runtime threads (0: the runtime's default). Default: 0.
        bf16 (bool): OpenVINO computes the fp32 model in bf16 (CPUs with bf16 units only);
            the same as ``precision='bf16'``. Default: False.
        precision (str, optional): 'fp32', 'bf16', 'int8' or 'auto': time the fp32 model
            and, in OpenVINO on a CPU with bf16 units, its bf16 form on the first test image
            and run the one that is at least ``AUTO_MARGIN`` times faster (never INT8, see
            :mod:`mmslab.utils.precision`). :attr:`precision` is what runs (after the test
            epoch began, for 'auto'), :attr:`auto_record` the measurement. Default: None
            (``int8`` and ``bf16`` decide; fp32 where neither is set).

    ``runtime`` and ``precision`` are used as given (``tools/test.py`` chooses them from the
    deployed form ``export.json`` records, :func:`mmslab.deploy.runtimes.choose_runtime_form`);
    the log line of the swap says whether they are that form (:attr:`recorded_form`).

    Its priority (HIGH) is below ``ReparamEvalHook`` (VERY_HIGH), which swaps in the fused
    copy first; the methods are patched on that copy, so ``ReparamEvalHook``'s equivalence
    check (unfused PyTorch vs the model the loop runs) then compares against the runtime.
    """

    priority = 'HIGH'

    def __init__(self, export_dir: str, runtime: str = 'onnxruntime', int8: bool = False,
                 threads: int = 0, bf16: bool = False, precision: Optional[str] = None):
        from mmslab.deploy.runtimes import resolve_precision
        self.export_dir = export_dir
        self.runtime = runtime
        self.requested = resolve_precision(precision, int8, bf16, runtime, auto=True)
        # auto: fp32 until the measurement (before the test epoch)
        self.precision = 'fp32' if self.requested == 'auto' else self.requested
        self.auto_record: Optional[dict] = None
        self.threads = threads
        self.info = read_export_info(export_dir)
        self.part = self.info['part']
        try:  # named in the log: whether what runs is the form the export deploys
            self.recorded_form = deployed_form(self.info)
        except ExportInfoError:
            self.recorded_form = None
        self._runtime_model = None
        self._patched: Optional[Tuple[nn.Module, dict, dict]] = None

    @property
    def int8(self) -> bool:
        return self.precision == 'int8'

    @property
    def bf16(self) -> bool:
        return self.precision == 'bf16'

    # -- patching ---------------------------------------------------------------------------
    def _load(self):
        if self._runtime_model is None:
            from mmslab.deploy.runtimes import load_runtime_model
            self._runtime_model = load_runtime_model(self.export_dir, self.runtime,
                                                     self.precision, self.threads)
        return self._runtime_model

    def _choose_precision(self, runner, model: nn.Module) -> None:
        """``auto``: fp32 against (OpenVINO, CPU with bf16 units) bf16 on the first test
        image, preprocessed and padded as the test loop feeds it; every rank takes rank 0's
        choice."""
        from mmengine.dist import broadcast_object_list

        from mmslab.deploy.runtimes import load_runtime_model
        from mmslab.utils.machine import has_bf16
        from mmslab.utils.precision import auto_precision, first_test_batch
        why_not = None
        if self.runtime != 'openvino':
            from mmslab.deploy.runtimes import ORT_NO_BF16
            why_not = ORT_NO_BF16.split(': ')[0]
        elif not has_bf16():
            why_not = 'this CPU has neither avx512_bf16 nor amx_bf16'
        models = {}
        if why_not is None:
            models = {p: load_runtime_model(self.export_dir, self.runtime, p, self.threads)
                      for p in ('fp32', 'bf16')}
            shape = None if self.info.get('dynamic') else self.info['shape']
            with torch.no_grad():
                data = model.data_preprocessor(first_test_batch(runner), False)
            image = RuntimePart(None, shape)._input(data['inputs'][:1])
            record = auto_precision({p: (lambda m=m: m(image)) for p, m in models.items()},
                                    True)
            record['what'] = (f"the {self.runtime} model on the first test image "
                              f"({'x'.join(map(str, image.shape[-2:]))})")
        else:
            record = auto_precision({}, False, why_not)
        shared = [record]
        broadcast_object_list(shared, src=0)
        self.auto_record = record = shared[0]
        self.precision = record['choice']
        self._runtime_model = models.get(self.precision)  # None: loaded by _load
        runner.logger.info(f"RuntimeBackendHook: auto chose {self.precision}: "
                           f"{record['reason']}")

    def _replacements(self, model: nn.Module) -> dict:
        segmentor, detector = is_segmentor(model), is_detector(model)
        part = self.part
        shape = None if self.info.get('dynamic') else self.info['shape']
        run = RuntimePart(self._load(), shape)
        if part == 'features':
            if not detector:
                raise RuntimeError(f"{self.export_dir} holds part 'features' (detector backbone "
                                   f'+ neck) but the model is a {type(model).__name__}')

            def extract_feat(batch_inputs):
                return tuple(run(batch_inputs))

            return dict(extract_feat=extract_feat)
        if part == 'backbone':
            if not (detector or segmentor):
                raise RuntimeError(f'cannot run a backbone export in a {type(model).__name__}')

            def extract_feat(inputs):
                x = tuple(run(inputs))
                if getattr(model, 'with_neck', False):
                    x = model.neck(x)
                return x

            return dict(extract_feat=extract_feat)
        if part == 'model' and detector:
            return dict(predict=self._detector_predict(model, run))
        if part == 'model':
            if not segmentor:
                raise RuntimeError(f"cannot run a whole-model export in a "
                                   f'{type(model).__name__}')
            if self.info.get('outputs') == ['seg_label']:
                raise RuntimeError(f'{self.export_dir} ends in argmax (--seg-argmax): mmseg '
                                   'evaluates logits; export without --seg-argmax to evaluate')
            head = model.decode_head
            if isinstance(head, nn.ModuleList):  # CascadeEncoderDecoder: the last head
                head = head[-1]

            def forward_logits(inputs, data_samples=None):
                outs = run(inputs)
                if len(outs) != 1:
                    raise RuntimeError(f"part 'model' returned {len(outs)} outputs, expected the "
                                       'logits only')
                return outs[0]

            def encode_decode(inputs, batch_img_metas):
                # what decode_head.predict does after forward: the resize to the (padded)
                # input size with the head's align_corners
                return head.predict_by_feat(forward_logits(inputs), batch_img_metas)

            # _forward: mode='tensor', which ReparamEvalHook's equivalence check calls
            return dict(encode_decode=encode_decode, _forward=forward_logits)
        raise RuntimeError(f'unknown part {part!r} in {self.export_dir}/export.json')

    def _detector_predict(self, model: nn.Module, run: 'RuntimePart'):
        """``predict`` of a detector whose whole network runs in the runtime."""
        names = self.info['outputs']
        if not {'dets', 'labels'} <= set(names):
            raise RuntimeError(f"{self.export_dir}: a detector export has outputs 'dets', "
                               f"'labels'[, 'masks'], not {names}")
        threshold = float(self.info.get('mask_thr_binary', 0.5))

        def predict(batch_inputs, batch_data_samples, rescale: bool = True):
            from mmengine.structures import InstanceData
            for i, sample in enumerate(batch_data_samples):
                outs = run.whole(batch_inputs[i:i + 1], names)
                dets, labels = outs['dets'].float(), outs['labels'].long()
                bboxes = dets[:, :4].clone()
                if rescale:  # mmdet divides by scale_factor, without clipping
                    scale = bboxes.new_tensor(sample.metainfo['scale_factor']).repeat(2)
                    bboxes /= scale
                results = InstanceData(bboxes=bboxes, scores=dets[:, 4], labels=labels)
                if 'masks' in outs:
                    h, w = sample.metainfo['ori_shape' if rescale else 'img_shape'][:2]
                    results.masks = paste_roi_masks(outs['masks'].float(), bboxes, h, w,
                                                    threshold)
                sample.pred_instances = results
            return batch_data_samples

        return predict

    def _enter(self, runner) -> None:
        self._exit(runner)  # a swap left by an epoch that never ended (not under a runner)
        model = _unwrap(runner.model)
        if self.requested == 'auto' and self.auto_record is None:
            self._choose_precision(runner, model)
        replacements = self._replacements(model)
        saved = {name: vars(model)[name] for name in replacements if name in vars(model)}
        self._patched = (model, replacements, saved)  # before the first setattr: _exit undoes
        for name, fn in replacements.items():
            setattr(model, name, fn)
        shape = 'dynamic' if self.info.get('dynamic') else 'x'.join(map(str, self.info['shape']))
        recorded = self.recorded_form
        if recorded is None:
            deployed = 'export.json records no deployed form'
        elif (recorded['runtime'], recorded['precision']) == (self.runtime, self.precision):
            deployed = 'the deployed form export.json records'
        else:
            deployed = (f"export.json's deployed form is {recorded['runtime']} "
                        f"{recorded['precision']}")
        runner.logger.info(
            f"RuntimeBackendHook: part '{self.part}' runs in {self.runtime} "
            f"({'INT8' if self.int8 else self.precision}, "
            f"{self._runtime_model.path}, input {shape}; {deployed}); "
            f'the rest of {type(model).__name__} in PyTorch')

    def _exit(self, runner=None) -> None:
        """Restore the patched methods (idempotent; ``runner`` is not needed)."""
        if self._patched is None:
            return
        model, replacements, saved = self._patched
        self._patched = None
        for name in replacements:
            if name in saved:
                setattr(model, name, saved[name])
            elif name in vars(model):
                delattr(model, name)

    def deployed_form(self) -> Optional[str]:
        """What the test steps run while the swap is in place, e.g. ``'openvino int8 whole
        model'`` or ``'onnxruntime fp32 backbone (the rest in PyTorch)'``; ``None`` outside
        it. ``ReparamEvalHook`` names its latency figures with it."""
        if self._patched is None:
            return None
        what = {'model': 'whole model', 'features': 'backbone + neck'}.get(self.part, self.part)
        rest = '' if self.part == 'model' else ' (the rest in PyTorch)'
        return f'{self.runtime} {self.precision} {what}{rest}'

    @contextmanager
    def runs_in_runtime(self, runner) -> Iterator[nn.Module]:
        """The swap as a context manager: inside the block the model that ``runner.model``
        unwraps to runs the exported part in the runtime; on leaving it, however that
        happens, its own methods are back. ``runner`` needs ``model`` and ``logger``."""
        self._enter(runner)
        try:
            yield self._patched[0]
        finally:
            self._exit(runner)

    # -- mmengine hook points ---------------------------------------------------------------
    # Test only: during training, validation must see the weights being trained, not an
    # artifact exported earlier.
    def before_run(self, runner) -> None:
        """Under ``runner.test()`` (the test loop is built before ``before_run``): run the test
        loop inside ``try/finally`` so that the model's methods are restored on every exit
        path. The guard is an attribute of that loop instance and removes itself."""
        loop = getattr(runner, '_test_loop', None)
        if not isinstance(loop, BaseLoop) or 'run' in vars(loop):
            return

        def run():
            try:
                return type(loop).run(loop)
            finally:
                del loop.run
                self._exit(runner)

        loop.run = run

    def before_test_epoch(self, runner) -> None:
        self._enter(runner)

    def after_test_epoch(self, runner, metrics=None) -> None:
        self._exit(runner)
