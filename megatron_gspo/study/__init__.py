"""A/B studies (`megatron-gspo study`): `arms` trains each arm of a study file (overrides of one
base config, same data order, seeds and sample budget) in its own process and resumes a killed
study; `study_report` summarises the arms' metrics (summary.json) and overlays their curves."""

from megatron_gspo.study.study_report import plot_study, summarize
from megatron_gspo.study.arms import StudySpec, arm_configs, load_study, run_study

__all__ = ["StudySpec", "arm_configs", "load_study", "run_study", "plot_study", "summarize"]
