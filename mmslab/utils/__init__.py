"""Small helpers for mmslab's tools."""
from .config_checks import (DataCheckError, DataNotFoundError, DatasetClassesError,
                            check_data_root, check_dataset_classes, missing_data_paths)

__all__ = [
    'DataCheckError', 'DataNotFoundError', 'DatasetClassesError', 'check_data_root',
    'check_dataset_classes', 'missing_data_paths'
]
