"""Delta weight sync: send only the weights that changed since the engine's last acknowledged
sync (codec: pure torch encoder; gspo_delta_loader: the server's custom loader, torch and the
standard library only; sender: the learner's base copy or hashes and the full/delta choice)."""
