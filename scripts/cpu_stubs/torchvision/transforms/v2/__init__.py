from torchvision import _unavailable
from torchvision.transforms import InterpolationMode  # noqa: F401
from torchvision.transforms.v2 import functional  # noqa: F401


def __getattr__(name):
    return _unavailable
