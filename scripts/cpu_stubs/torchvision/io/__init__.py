from torchvision import _unavailable


def __getattr__(name):
    return _unavailable
