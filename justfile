# Baton's recipes. `./baton just --list` works on a fresh clone (it installs first).

set positional-arguments

# list the recipes
default:
    @just --list

# start NATS, Redis and every service of a cluster file; serve the OpenAI API
up *args:
    ./baton up "$@"

# run the default test suite (pytest args pass through)
test *args:
    ./baton test "$@"

# run every suite, the slow ones too
test-all *args:
    ./baton test --slow "$@"

# ruff and mypy over the project, and the history-word check over every file
lint:
    ./baton ruff check services shared loadgen bench scripts tests
    ./baton mypy services shared loadgen bench scripts
    ./baton python scripts/check_history.py

# compile the SFS replay kernel with mypyc (./baton does it at install), then say which loads
native:
    ./baton python -m services.estimator.sfs build-native
    ./baton python -m services.estimator.sfs kernel

# report the data directory (traces, prompt sets; BATON_DATA_DIR, default data/); --from DIR links them
data *args:
    ./baton python -m loadgen.data "$@"

# build the smaller SmolLM2 family members (models/*.safetensors) by distillation
models *args:
    ./baton python scripts/build_models.py "$@"

# measure the family: decode latency, agreement with the full model, perplexity
eval-models *args:
    ./baton python scripts/eval_models.py "$@"

# engine vs HF transformers generate() on SmolLM2 (tok/s, ratio; JSON to --out)
bench-engine *args:
    ./baton python scripts/bench_engine.py "$@"

# drive an OpenAI-compatible endpoint with arrivals, traces and workloads
loadgen *args:
    ./baton python -m loadgen "$@"

# TTFT and stream throughput through gateway + direct link (or NATS) + worker vs an in-process engine
bench-gateway *args:
    ./baton python scripts/bench_gateway.py "$@"

# cost of one SFS routing decision (3 and 13 instances)
bench-sfs-decision *args:
    ./baton python scripts/bench_sfs_decision.py "$@"

# per-step decode latency of the model family as served by the engine
family-latency *args:
    ./baton python scripts/family_latency.py "$@"

# the DTMC's predicted throughput vs a measured run for B = 1..N
check-dtmc *args:
    ./baton python scripts/check_dtmc.py "$@"

# train the output-length and quality predictors (xgboost) from the models' own labels
predictors *args:
    ./baton python scripts/train_predictors.py "$@"

# SFS: TTFT prediction error, OnTimeUtility vs rate on the simulated cluster, delta frontier, decision cost
bench-sfs *args:
    ./baton python scripts/bench_sfs.py "$@"

# SFS's own TTFT error on a simulated engine (no machine noise): length ratios, snapshot ages
sfs-bias *args:
    ./baton python scripts/sfs_bias.py "$@"

# train the token-level routers (R2R, CITER, Co-LLM) from the family's own labels
routers *args:
    ./baton python scripts/train_routers.py "$@"

# token-level routing: every policy vs the baselines, closed loop (JSON to --out)
bench-token *args:
    ./baton python scripts/bench_token.py "$@"
