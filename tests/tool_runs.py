"""Running mmslab's tools on tiny configs and synthetic data: the helpers and the
``demo_data`` fixture that the end-to-end test modules share (import them from here;
``test_tools_e2e`` re-exports them for the modules that import them from there)."""
import json
import os
import os.path as osp
import socket
import subprocess

import pytest

REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TOOLS = osp.join(REPO_ROOT, 'tools')

METRICS_PREFIX = 'mmslab-test-metrics: '
BN = dict(type='BN', requires_grad=True)
MEAN = [123.675, 116.28, 103.53]
STD = [58.395, 57.12, 57.375]


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def exit_message(capsys, fn, *args) -> str:
    """``fn(*args)`` must exit (argparse error or SystemExit('error: ...')): its message."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as err:
        fn(*args)
    code = err.value.code
    return (code if isinstance(code, str) else '') + capsys.readouterr().err


def run_tool(args, cwd, timeout=300, env=None):
    """Run a command, fail the test with the end of its output if it exits non-zero."""
    full_env = dict(os.environ)
    full_env['PYTHONPATH'] = os.pathsep.join(
        p for p in (REPO_ROOT, os.environ.get('PYTHONPATH', '')) if p)
    full_env.update(env or {})
    proc = subprocess.run([str(a) for a in args], cwd=str(cwd), env=full_env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f'command failed with exit code {proc.returncode}: {" ".join(map(str, args))}'
                    f'\n--- last output ---\n{proc.stdout[-6000:]}')
    return proc.stdout


def write_config(path, cfg: dict) -> str:
    """Write a plain-dict mmengine config as a Python file."""
    with open(path, 'w') as f:
        for key, value in cfg.items():
            f.write(f'{key} = {value!r}\n')
    return str(path)


def parse_metrics(output: str) -> dict:
    lines = [ln for ln in output.splitlines() if ln.startswith(METRICS_PREFIX)]
    assert lines, f'tools/test.py printed no metrics line:\n{output[-3000:]}'
    return json.loads(lines[-1][len(METRICS_PREFIX):])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def runtime_cfg(work_dir, vis_hook, visualizer):
    return dict(
        default_scope=None,  # set by the caller
        work_dir=str(work_dir),
        train_cfg=dict(type='IterBasedTrainLoop', max_iters=2, val_interval=2),
        val_cfg=dict(type='ValLoop'),
        test_cfg=dict(type='TestLoop'),
        optim_wrapper=dict(type='OptimWrapper',
                           optimizer=dict(type='AdamW', lr=1e-4, weight_decay=1e-4)),
        param_scheduler=[dict(type='LinearLR', start_factor=0.5, by_epoch=False, begin=0,
                              end=2)],
        default_hooks=dict(
            timer=dict(type='IterTimerHook'),
            logger=dict(type='LoggerHook', interval=1),
            param_scheduler=dict(type='ParamSchedulerHook'),
            checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=2),
            sampler_seed=dict(type='DistSamplerSeedHook'),
            visualization=dict(type=vis_hook)),
        # 'nccl' on purpose: the tools must switch to gloo on a machine without CUDA
        env_cfg=dict(cudnn_benchmark=False,
                     mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
                     dist_cfg=dict(backend='nccl')),
        vis_backends=[dict(type='LocalVisBackend')],
        visualizer=dict(type=visualizer, vis_backends=[dict(type='LocalVisBackend')],
                        name='visualizer'),
        log_processor=dict(type='LogProcessor', window_size=1, by_epoch=False),
        log_level='INFO',
        load_from=None,
        resume=False,
        randomness=dict(seed=0),
    )


def det_config(data_root, work_dir) -> dict:
    from mmslab.datasets import COCO_DEMO_CLASSES
    num_classes = len(COCO_DEMO_CLASSES)
    scale = (96, 96)
    train_pipeline = [
        dict(type='LoadImageFromFile'),
        dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
        dict(type='Resize', scale=scale, keep_ratio=True),
        dict(type='RandomFlip', prob=0.5),
        dict(type='PackDetInputs'),
    ]
    test_pipeline = [
        dict(type='LoadImageFromFile'),
        dict(type='Resize', scale=scale, keep_ratio=True),
        dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
        dict(type='PackDetInputs',
             meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
    ]

    def dataset(split, pipeline, test_mode):
        return dict(type='CocoDataset', data_root=str(data_root),
                    metainfo=dict(classes=tuple(COCO_DEMO_CLASSES)),
                    ann_file=f'annotations/instances_{split}2017.json',
                    data_prefix=dict(img=f'{split}2017/'), test_mode=test_mode,
                    filter_cfg=None if test_mode else dict(filter_empty_gt=True, min_size=4),
                    pipeline=pipeline)

    def roi_extractor(size):
        return dict(type='SingleRoIExtractor',
                    roi_layer=dict(type='RoIAlign', output_size=size, sampling_ratio=2),
                    out_channels=32, featmap_strides=[4, 8, 16, 32])

    model = dict(
        type='MaskRCNN',
        data_preprocessor=dict(type='DetDataPreprocessor', mean=MEAN, std=STD, bgr_to_rgb=True,
                               pad_mask=True, pad_size_divisor=32),
        backbone=dict(type='ResNet', depth=18, base_channels=16, stem_channels=16,
                      num_stages=4, out_indices=(0, 1, 2, 3), frozen_stages=-1, norm_cfg=BN,
                      norm_eval=False, style='pytorch'),
        neck=dict(type='FPN', in_channels=[16, 32, 64, 128], out_channels=32, num_outs=5),
        rpn_head=dict(
            type='RPNHead', in_channels=32, feat_channels=32,
            anchor_generator=dict(type='AnchorGenerator', scales=[4], ratios=[0.5, 1.0, 2.0],
                                  strides=[4, 8, 16, 32, 64]),
            bbox_coder=dict(type='DeltaXYWHBBoxCoder', target_means=[0.0] * 4,
                            target_stds=[1.0] * 4),
            loss_cls=dict(type='CrossEntropyLoss', use_sigmoid=True, loss_weight=1.0),
            loss_bbox=dict(type='L1Loss', loss_weight=1.0)),
        roi_head=dict(
            type='StandardRoIHead',
            bbox_roi_extractor=roi_extractor(7),
            bbox_head=dict(
                type='Shared2FCBBoxHead', in_channels=32, fc_out_channels=64, roi_feat_size=7,
                num_classes=num_classes,
                bbox_coder=dict(type='DeltaXYWHBBoxCoder', target_means=[0.0] * 4,
                                target_stds=[0.1, 0.1, 0.2, 0.2]),
                reg_class_agnostic=False,
                loss_cls=dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0),
                loss_bbox=dict(type='L1Loss', loss_weight=1.0)),
            mask_roi_extractor=roi_extractor(14),
            mask_head=dict(type='FCNMaskHead', num_convs=1, in_channels=32,
                           conv_out_channels=32, num_classes=num_classes,
                           loss_mask=dict(type='CrossEntropyLoss', use_mask=True,
                                          loss_weight=1.0))),
        train_cfg=dict(
            rpn=dict(assigner=dict(type='MaxIoUAssigner', pos_iou_thr=0.7, neg_iou_thr=0.3,
                                   min_pos_iou=0.3, match_low_quality=True, ignore_iof_thr=-1),
                     sampler=dict(type='RandomSampler', num=64, pos_fraction=0.5,
                                  neg_pos_ub=-1, add_gt_as_proposals=False),
                     allowed_border=-1, pos_weight=-1, debug=False),
            rpn_proposal=dict(nms_pre=200, max_per_img=50, nms=dict(type='nms',
                                                                    iou_threshold=0.7),
                              min_bbox_size=0),
            rcnn=dict(assigner=dict(type='MaxIoUAssigner', pos_iou_thr=0.5, neg_iou_thr=0.5,
                                    min_pos_iou=0.5, match_low_quality=True, ignore_iof_thr=-1),
                      sampler=dict(type='RandomSampler', num=32, pos_fraction=0.25,
                                   neg_pos_ub=-1, add_gt_as_proposals=True),
                      mask_size=28, pos_weight=-1, debug=False)),
        # score_thr=0: an untrained model still yields detections, so COCO metrics exist
        test_cfg=dict(
            rpn=dict(nms_pre=200, max_per_img=50, nms=dict(type='nms', iou_threshold=0.7),
                     min_bbox_size=0),
            rcnn=dict(score_thr=0.0, nms=dict(type='nms', iou_threshold=0.5), max_per_img=20,
                      mask_thr_binary=0.5)))

    val_loader = dict(batch_size=2, num_workers=0, persistent_workers=False, drop_last=False,
                      sampler=dict(type='DefaultSampler', shuffle=False),
                      dataset=dataset('val', test_pipeline, True))
    evaluator = dict(type='CocoMetric',
                     ann_file=osp.join(str(data_root), 'annotations', 'instances_val2017.json'),
                     metric=['bbox', 'segm'], format_only=False)
    cfg = runtime_cfg(work_dir, 'DetVisualizationHook', 'DetLocalVisualizer')
    cfg.update(
        default_scope='mmdet',
        model=model,
        train_dataloader=dict(batch_size=2, num_workers=0, persistent_workers=False,
                              sampler=dict(type='DefaultSampler', shuffle=True),
                              dataset=dataset('train', train_pipeline, False)),
        val_dataloader=val_loader, test_dataloader=val_loader,
        val_evaluator=evaluator, test_evaluator=evaluator)
    return cfg


def seg_config(data_root, work_dir) -> dict:
    size = (64, 64)
    train_pipeline = [
        dict(type='LoadImageFromFile'),
        dict(type='LoadAnnotations', reduce_zero_label=True),
        dict(type='Resize', scale=size, keep_ratio=True),
        dict(type='RandomFlip', prob=0.5),
        dict(type='PackSegInputs'),
    ]
    test_pipeline = [
        dict(type='LoadImageFromFile'),
        dict(type='Resize', scale=size, keep_ratio=True),
        dict(type='LoadAnnotations', reduce_zero_label=True),
        dict(type='PackSegInputs'),
    ]

    def dataset(split, pipeline):
        return dict(type='ADE20KDataset', data_root=str(data_root),
                    data_prefix=dict(img_path=f'images/{split}',
                                     seg_map_path=f'annotations/{split}'),
                    pipeline=pipeline)

    model = dict(
        type='EncoderDecoder',
        data_preprocessor=dict(type='SegDataPreProcessor', mean=MEAN, std=STD, bgr_to_rgb=True,
                               pad_val=0, seg_pad_val=255, size=size),
        backbone=dict(type='ResNetV1c', depth=18, base_channels=16, stem_channels=16,
                      num_stages=4, out_indices=(0, 1, 2, 3), dilations=(1, 1, 1, 1),
                      strides=(1, 2, 2, 2), norm_cfg=BN, norm_eval=False, style='pytorch',
                      contract_dilation=True),
        decode_head=dict(type='FCNHead', in_channels=128, in_index=3, channels=32, num_convs=1,
                         concat_input=False, dropout_ratio=0.1, num_classes=150, norm_cfg=BN,
                         align_corners=False,
                         loss_decode=dict(type='CrossEntropyLoss', use_sigmoid=False,
                                          loss_weight=1.0)),
        train_cfg=dict(),
        test_cfg=dict(mode='whole'))
    val_loader = dict(batch_size=1, num_workers=0, persistent_workers=False,
                      sampler=dict(type='DefaultSampler', shuffle=False),
                      dataset=dataset('validation', test_pipeline))
    evaluator = dict(type='IoUMetric', iou_metrics=['mIoU'])
    cfg = runtime_cfg(work_dir, 'SegVisualizationHook', 'SegLocalVisualizer')
    cfg.update(
        default_scope='mmseg',
        model=model,
        train_dataloader=dict(batch_size=2, num_workers=0, persistent_workers=False,
                              sampler=dict(type='InfiniteSampler', shuffle=True),
                              dataset=dataset('training', train_pipeline)),
        val_dataloader=val_loader, test_dataloader=val_loader,
        val_evaluator=evaluator, test_evaluator=evaluator)
    return cfg


def tiny_prepbn_swin_config(task: str, data_root, work_dir, body_step: int = 2,
                            out_step: int = 2) -> dict:
    """``det_config``/``seg_config`` with a tiny PRepBN Swin (something to fuse) and, for
    segmentation, UperNet as in the real configs (every backbone output and output norm is
    used), with mmslab's hooks."""
    cfg = det_config(data_root, work_dir) if task == 'det' else seg_config(data_root, work_dir)
    cfg['model']['backbone'] = dict(
        type='ReparamSwinTransformer', embed_dims=16, depths=(1, 1, 1, 1),
        num_heads=(1, 2, 2, 4), window_size=4, out_indices=(0, 1, 2, 3),
        norm_cfg=dict(type='PRepBN', step=body_step),
        out_norm_cfg=dict(type='PRepBN', step=out_step))
    if task == 'seg':
        head = cfg['model']['decode_head']
        cfg['model']['decode_head'] = dict(
            type='UPerHead', in_channels=[16, 32, 64, 128], in_index=[0, 1, 2, 3],
            pool_scales=(1, 2), channels=16, dropout_ratio=0.1, num_classes=150,
            norm_cfg=head['norm_cfg'], align_corners=False, loss_decode=head['loss_decode'])
    cfg['custom_imports'] = dict(imports=['mmslab'], allow_failed_imports=False)
    cfg['custom_hooks'] = [dict(type='ProgressiveNormHook'),
                           dict(type='ReparamEvalHook', warmup=0)]
    return cfg


def make_demo_sets(root) -> dict:
    """The tools' demo sets under ``root``: {'det': the COCO root, 'seg': the ADE20K root}."""
    from mmslab.datasets import make_ade_demo, make_coco_demo
    coco, ade = root / 'coco', root / 'ade'
    make_coco_demo(str(coco), num_train=8, num_val=4, img_size=96, seed=0, progress=False)
    make_ade_demo(str(ade), num_train=8, num_val=4, img_size=64, seed=0, progress=False)
    return dict(det=coco, seg=ade / 'ADEChallengeData2016')


@pytest.fixture(scope='module')
def demo_data(tmp_path_factory):
    return make_demo_sets(tmp_path_factory.mktemp('demo_data'))
