# test stand-in: one class attribute and one default, shaped like the ones commbench reads


class CustomAllreduce:
    _SUPPORTED_WORLD_SIZES = [2, 4, 8]

    def __init__(self, group, device, max_size=8 * 1024 * 1024):
        self.max_size = max_size
