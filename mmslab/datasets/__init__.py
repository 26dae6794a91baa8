"""Dataset utilities: synthetic COCO / ADE20K demo data generators."""
from .demo_data import (ADE_DEMO_CLASSES, COCO_DEMO_CLASSES, ade_demo_complete,
                        coco_demo_complete, make_ade_demo, make_coco_demo)

__all__ = [
    'COCO_DEMO_CLASSES', 'ADE_DEMO_CLASSES', 'make_coco_demo', 'make_ade_demo',
    'coco_demo_complete', 'ade_demo_complete'
]
