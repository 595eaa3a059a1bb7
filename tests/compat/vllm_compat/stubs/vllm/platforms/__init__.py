class _CPU:
    def is_rocm(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return True


current_platform = _CPU()
