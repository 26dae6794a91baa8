"""Small helpers for mmslab's tools."""
from .config_checks import DataNotFoundError, check_data_root, missing_data_paths

__all__ = ['DataNotFoundError', 'check_data_root', 'missing_data_paths']
