"""Run-directory services: verified atomic checkpoints (`checkpoint`), the one-writer run lock and
fresh-start checks (`rundir`), metrics logging (`metrics`), fault injection for chaos tests
(`faults`), and child processes tied to the trainer's life (`exec_with_parent`)."""
