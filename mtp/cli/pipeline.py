"""`mtp pipeline`: decode one prompt across P pipeline stages (`mtp.pipeline`), as local processes
or, under torchrun, one stage per process (`python -m mtp.pipeline`, same options)."""
from __future__ import annotations

from mtp.cli.options import check_decoding_args, read_prompt
from mtp.core.costmodel import parse_cluster, predict_cluster
from mtp.core.loading import model_layers
from mtp.pipeline.launch import add_stage_args, cli_stage, config_from_args, launch_local
from mtp.pipeline.stages import layer_ranges


def add_parser(sub) -> None:
    p = sub.add_parser("pipeline", help="decode across P pipeline stages (local processes) on torch.distributed",
                       description="Split the model's layers over P local processes linked by torch.distributed "
                                   "and decode one prompt; across machines run `torchrun ... -m mtp.pipeline` "
                                   "with the same options.")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages = local processes (default 2)")
    add_stage_args(p)
    p.add_argument("--predict", metavar="SPEC",
                   help="print the cost model's prediction for a cluster instead of running, e.g. "
                        "stages=8,latency_ms=0.5,pass_ms=40,tokens_per_pass=3[,block_cost=1.1,"
                        "bandwidth_gbps=10,dim=4096,vocab=128256,dtype_bytes=2]")
    p.set_defaults(func=run)


def run(args) -> int:
    """`mtp pipeline`: validate here, then launch the stages (stage 0 prints the result)."""
    if args.predict:
        print_prediction(args.predict)
        return 0
    check_decoding_args(args)
    config_from_args(args)
    if "eagle3" in args.proposer.split("+"):  # its drafter reads trunk layers that other stages hold
        raise ValueError("mtp pipeline does not run --proposer eagle3 (its drafter reads residual streams of layers "
                         "spread over the stages); use heads, suffix, lookup or a merge of them")
    if args.stages < 1:
        raise ValueError("--stages must be >= 1")
    n_layers = model_layers(args.model)  # from the config alone: no stage starts before this check
    if n_layers is not None:
        layer_ranges(n_layers, args.stages)
    args.prompt = read_prompt(args)
    return launch_local(args.stages, cli_stage, (args,))


def print_prediction(spec: str) -> None:
    cluster = parse_cluster(spec)
    print(predict_cluster(**cluster)["text"])
