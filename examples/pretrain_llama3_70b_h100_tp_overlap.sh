#!/bin/bash
# A Megatron-LM launch script for Llama 3 70B on 64 H100s (8 nodes), as NVIDIA's BF16
# performance recipe runs it: tp 4 with sequence parallelism and Transformer Engine's TP
# communication overlap (its userbuffers configured by examples/userbuffers_bf16_h100_h8192_tp4.yaml),
# pp 4 with 5 virtual stages, cp 2, the distributed optimizer. metatrace reads its arguments
# (from the repository's root, where the configuration's path holds):
#   metatrace run examples/pretrain_llama3_70b_h100_tp_overlap.sh --gpu h100
# (64 GPUs, 8 a node, from the torchrun line below)
export CUDA_DEVICE_MAX_CONNECTIONS=1

torchrun --nproc_per_node 8 --nnodes 8 pretrain_gpt.py \
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 \
    --num-attention-heads 64 --group-query-attention --num-query-groups 8 \
    --seq-length 8192 --max-position-embeddings 8192 \
    --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu \
    --disable-bias-linear --untie-embeddings-and-output-weights \
    --attention-dropout 0.0 --hidden-dropout 0.0 \
    --tokenizer-type NullTokenizer --vocab-size 128255 \
    --micro-batch-size 1 --global-batch-size 256 --bf16 --grad-reduce-in-bf16 \
    --tensor-model-parallel-size 4 --sequence-parallel \
    --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 5 \
    --context-parallel-size 2 \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
    --tp-comm-overlap --tp-comm-overlap-cfg examples/userbuffers_bf16_h100_h8192_tp4.yaml \
    --cross-entropy-loss-fusion --cross-entropy-fusion-impl te \
    --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine --train-iters 1000 \
    --data-path /data/llama3_text_document --split 99,1,0 \
    --save /checkpoints/llama3-70b --save-interval 500 --log-interval 10
