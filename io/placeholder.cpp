namespace strata::io {}
