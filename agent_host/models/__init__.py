"""Models behind one interface, and the registry that names them by id."""

from .base import Accumulator, ChatModel, ModelError
from .offline import OfflineRuleModel
from .registry import ModelRegistry, UnknownModelError

__all__ = ["Accumulator", "ChatModel", "ModelError", "ModelRegistry", "OfflineRuleModel", "UnknownModelError"]
