"""The optimizer: a MegatronOptimizer shell (optimizer.py) over update rules, one file
each (adamw.py, muon.py, muon_tp.py), listed in registry.py. Import the shell from
``megatron_mfsdp.optim.optimizer`` (or the package root)."""
