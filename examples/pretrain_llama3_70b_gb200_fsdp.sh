#!/bin/bash
# A Megatron-LM launch script for Llama 3 70B on 64 GB200s (16 trays of 4 GPUs), as NVIDIA's
# BF16 performance recipe runs it: Megatron-FSDP sharding everything over the 64 GPUs, and
# Transformer Engine offloading the first 20 layers' activations to host memory.
# metatrace reads its arguments:
#   metatrace run examples/pretrain_llama3_70b_gb200_fsdp.sh --gpu gb200
# (64 GPUs, 4 a node, from the torchrun line below)
export CUDA_DEVICE_MAX_CONNECTIONS=32

torchrun --nproc_per_node 4 --nnodes 16 pretrain_gpt.py \
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 \
    --num-attention-heads 64 --group-query-attention --num-query-groups 8 \
    --seq-length 8192 --max-position-embeddings 8192 \
    --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu \
    --disable-bias-linear --untie-embeddings-and-output-weights \
    --attention-dropout 0.0 --hidden-dropout 0.0 \
    --tokenizer-type NullTokenizer --vocab-size 128255 \
    --micro-batch-size 1 --global-batch-size 256 --bf16 --grad-reduce-in-bf16 \
    --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params \
    --fsdp-double-buffer --suggested-communication-unit-size 800000000 \
    --no-gradient-accumulation-fusion --cpu-offloading-num-layers 20 \
    --cross-entropy-loss-fusion --cross-entropy-fusion-impl te \
    --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine --train-iters 1000 \
    --data-path /data/llama3_text_document --split 99,1,0 \
    --save /checkpoints/llama3-70b --save-interval 500 --log-interval 10
