"""The optimizer: a MegatronOptimizer shell (optimizer.py) over update rules, one file
each (muon.py, adaptive_muon.py, soap.py, shampoo.py on matrix.py's MatrixMath; adamw.py,
lion.py, sgd.py elementwise), listed in registry.py. Import the shell from
``megatron_mfsdp.optim.optimizer`` (or the package root)."""
