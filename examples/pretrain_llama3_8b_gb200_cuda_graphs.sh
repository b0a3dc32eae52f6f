#!/bin/bash
# A Megatron-LM launch script for Llama 3 8B on 8 GB200s (2 trays of 4 GPUs), as NVIDIA's BF16
# performance recipe runs it: data parallelism only and a CUDA graph of each whole iteration.
# metatrace reads its arguments:
#   metatrace run examples/pretrain_llama3_8b_gb200_cuda_graphs.sh --gpu gb200
# (8 GPUs, 4 a node, from the torchrun line below)
export CUDA_DEVICE_MAX_CONNECTIONS=32
export NCCL_GRAPH_REGISTER=0
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,graph_capture_record_stream_reuse:True

torchrun --nproc_per_node 4 --nnodes 2 pretrain_gpt.py \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 \
    --num-attention-heads 32 --group-query-attention --num-query-groups 8 \
    --seq-length 8192 --max-position-embeddings 8192 \
    --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu \
    --disable-bias-linear --untie-embeddings-and-output-weights \
    --attention-dropout 0.0 --hidden-dropout 0.0 \
    --tokenizer-type NullTokenizer --vocab-size 128255 \
    --micro-batch-size 2 --global-batch-size 128 --bf16 \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
    --cuda-graph-impl local --cuda-graph-scope full_iteration --te-rng-tracker \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --train-iters 1000 \
    --data-path /data/llama3_text_document --split 99,1,0 \
    --save /checkpoints/llama3-8b --save-interval 500 --log-interval 10
