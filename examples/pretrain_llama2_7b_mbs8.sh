#!/bin/bash
# examples/pretrain_llama2_7b.sh with micro-batches of 8 sequences: out of memory by 7 GiB on the
# first pipeline stage. metatrace says so and traces the single changes that make it fit:
#   metatrace run examples/pretrain_llama2_7b_mbs8.sh   (16 GPUs, from the torchrun line below)
export CUDA_DEVICE_MAX_CONNECTIONS=1

torchrun --nproc_per_node 8 --nnodes 2 pretrain_gpt.py \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 \
    --num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096 \
    --position-embedding-type rope --normalization RMSNorm --swiglu \
    --disable-bias-linear --untie-embeddings-and-output-weights \
    --attention-dropout 0.0 --hidden-dropout 0.0 \
    --tokenizer-type NullTokenizer --vocab-size 31999 \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \
    --micro-batch-size 8 --global-batch-size 64 \
    --bf16 --use-distributed-optimizer --overlap-grad-reduce \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --train-iters 1000 \
    --data-path /data/llama2_text_document --split 99,1,0 \
    --save /checkpoints/llama2-7b --save-interval 500 --log-interval 10
