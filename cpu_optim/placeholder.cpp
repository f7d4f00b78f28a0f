namespace strata::cpu_optim {}
