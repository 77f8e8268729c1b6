"""Run-time services of a training run (the loop itself is `loop/`): verified atomic checkpoints
of a run (`run_checkpoint`), the one-writer run lock and fresh-start checks (`rundir`), metrics
logging (`metrics`), the device-memory ledger (`device_ledger`), durable writes and a full disk
(`durable`, `diskfull`), automatic restarts (`restarts`), the servers a run launched
(`server_record`), fault injection for chaos tests (`faults`), and child processes tied to the
trainer's life (`exec_with_parent`)."""
