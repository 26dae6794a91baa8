"""Dataset utilities: synthetic COCO / ADE20K demo data generators."""
from .demo_data import (ADE_DEMO_CLASSES, COCO_DEMO_CLASSES, DEMO_DATA_ROOT, ForeignDataError,
                        ade_demo_complete, check_demo_target, coco_demo_complete,
                        foreign_entries, make_ade_demo, make_coco_demo)

__all__ = [
    'COCO_DEMO_CLASSES', 'ADE_DEMO_CLASSES', 'DEMO_DATA_ROOT', 'ForeignDataError',
    'make_coco_demo', 'make_ade_demo', 'coco_demo_complete', 'ade_demo_complete',
    'foreign_entries', 'check_demo_target'
]
