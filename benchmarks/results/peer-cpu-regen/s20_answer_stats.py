"""CPU lab (twentieth session): length, end-of-turn and repetition of regenerated answers (RUN/regen/shard-*.jsonl), re-tokenized; argv: run folders. Run from the repository root."""
import json, sys, glob
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained("assets/tiny-llama-sharegpt")
res = {}
for d in sys.argv[1:]:
    lens, rep4, distinct1 = [], [], []
    for f in sorted(glob.glob(f"{d}/regen/shard-*.jsonl")):
        for line in open(f):
            for m in json.loads(line)["messages"]:
                if m["role"] != "assistant": continue
                ids = tok(m["content"], add_special_tokens=False)["input_ids"]
                lens.append(len(ids))
                g = [tuple(ids[i:i+4]) for i in range(len(ids) - 3)]
                if g: rep4.append(1 - len(set(g)) / len(g))
                if ids: distinct1.append(len(set(ids)) / len(ids))
    n = len(lens)
    res[d] = {"answers": n, "mean_tokens": sum(lens) / n, "ended_before_94_tokens": sum(l < 94 for l in lens) / n,
              "empty": sum(l == 0 for l in lens) / n, "repeated_4gram_share": sum(rep4) / len(rep4), "distinct_token_share": sum(distinct1) / len(distinct1)}
    print(d, json.dumps({k: round(v, 3) for k, v in res[d].items()}))
json.dump(res, open("/tmp/s20_answer_stats.json", "w"), indent=1)
