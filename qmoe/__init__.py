"""qmoe: CUDA-native inference of Qwen3.5-MoE on Triton kernels, with ExecuTorch's device tensor pipeline."""


def run_experiment(cfg, run_dir=None, progress: bool = False, models=None) -> dict:
    """Run one composed config end to end and return what results.json holds (see qmoe.app; `models`: a
    qmoe.app.ModelCache of the caller's, default the process's)."""
    from qmoe.app import run_experiment as run

    return run(cfg, run_dir=run_dir, progress=progress, models=models)
