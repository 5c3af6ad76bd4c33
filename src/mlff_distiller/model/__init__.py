"""The student model."""

from .painn import ModelConfig, StudentModel

__all__ = ["ModelConfig", "StudentModel"]
