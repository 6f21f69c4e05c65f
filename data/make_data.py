"""
Regenerate the embedded default data of refcache, from nothing, in about two CPU minutes:

  1. a synthetic instruction corpus built from task templates with a seeded RNG,
  2. a byte-level BPE tokenizer trained on it (with a chat template),
  3. a tiny Llama-style SFT model trained on the chat-templated corpus  -> sft-model/
  4. preference pairs whose only difference is an opening style marker -> prefs/, prefs-standard/

Run:  .venv/bin/python data/make_data.py        (writes next to this file; byte-identical on rerun)
"""

import hashlib
import json
import math
import os
import random
import stat
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# -----------------------------------------------------------------------------
# settings
SEED = 1337
OUT = Path(__file__).resolve().parent
VOCAB_SIZE = 1024
N_POOL = 4000               # unique prompts drawn from the templates
N_TRAIN_PAIRS, N_EVAL_PAIRS = 400, 100
N_SFT = 2000                # SFT conversations, one per prompt (incl. the train-pair prompts, never eval prompts)
SFT_STEPS, BATCH, LR = 1200, 32, 3e-3
CHOSEN_MARK, REJECTED_MARK = "Sure!", "Hmm."   # the preference: chosen answers open with "Sure!"
SPECIALS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

torch.manual_seed(SEED)
torch.set_num_threads(1)            # one thread: same float reductions on every run and machine size
torch.use_deterministic_algorithms(True)
t0 = time.time()

# -----------------------------------------------------------------------------
# 1. task templates: each returns (user prompt, plain answer); answers are determined by the prompt
COLOURS = {"banana": "yellow", "lemon": "yellow", "tomato": "red", "strawberry": "red", "cherry": "red",
           "lime": "green", "cucumber": "green", "frog": "green", "grass": "green", "leaf": "green",
           "carrot": "orange", "pumpkin": "orange", "orange": "orange", "sky": "blue", "blueberry": "blue",
           "snow": "white", "cloud": "white", "milk": "white", "coal": "black", "crow": "black",
           "plum": "purple", "grape": "purple", "eggplant": "purple", "chocolate": "brown", "bear": "brown",
           "flamingo": "pink", "pig": "pink", "sun": "yellow", "ruby": "red", "emerald": "green"}
ANIMALS = {  # name: (sound, home, baby)
    "dog": ("woof", "a kennel", "puppy"), "cat": ("meow", "a house", "kitten"), "cow": ("moo", "a barn", "calf"),
    "duck": ("quack", "a pond", "duckling"), "sheep": ("baa", "a field", "lamb"), "horse": ("neigh", "a stable", "foal"),
    "pig": ("oink", "a sty", "piglet"), "lion": ("roar", "a den", "cub"), "owl": ("hoot", "a tree", "owlet"),
    "bee": ("buzz", "a hive", "larva"), "goat": ("bleat", "a farm", "kid"), "frog": ("croak", "a pond", "tadpole"),
    "mouse": ("squeak", "a hole", "pup"), "snake": ("hiss", "a burrow", "snakelet"), "wolf": ("howl", "a den", "pup"),
    "hen": ("cluck", "a coop", "chick"), "bird": ("tweet", "a nest", "chick"), "bear": ("growl", "a cave", "cub")}
ABILITIES = {"fly": ["a bird", "a bat", "an owl", "a bee", "a duck"], "swim": ["a fish", "a duck", "a frog", "a seal"],
             "climb trees": ["a cat", "a monkey", "a squirrel", "a koala"], "run fast": ["a horse", "a cheetah", "a dog"],
             "jump high": ["a kangaroo", "a frog", "a rabbit"], "dig": ["a mole", "a dog", "a rabbit"]}
OPPOSITES = {"hot": "cold", "big": "small", "up": "down", "fast": "slow", "happy": "sad", "day": "night",
             "open": "closed", "light": "dark", "old": "new", "wet": "dry", "early": "late", "full": "empty",
             "hard": "soft", "high": "low", "left": "right", "loud": "quiet", "long": "short", "near": "far",
             "rich": "poor", "strong": "weak", "thick": "thin", "win": "lose", "yes": "no", "in": "out"}
OPPOSITES.update({v: k for k, v in list(OPPOSITES.items())})
PLURALS = {"cat": "cats", "dog": "dogs", "box": "boxes", "bus": "buses", "child": "children", "mouse": "mice",
           "foot": "feet", "tooth": "teeth", "man": "men", "woman": "women", "city": "cities", "baby": "babies",
           "leaf": "leaves", "knife": "knives", "sheep": "sheep", "fish": "fish", "goose": "geese", "book": "books",
           "apple": "apples", "house": "houses", "car": "cars", "tree": "trees", "wolf": "wolves", "key": "keys"}
CAPITALS = {"France": "Paris", "Spain": "Madrid", "Italy": "Rome", "Germany": "Berlin", "Japan": "Tokyo",
            "Egypt": "Cairo", "Kenya": "Nairobi", "Canada": "Ottawa", "Peru": "Lima", "Norway": "Oslo",
            "Greece": "Athens", "Ireland": "Dublin", "Poland": "Warsaw", "Portugal": "Lisbon", "China": "Beijing",
            "India": "New Delhi", "Russia": "Moscow", "Mexico": "Mexico City", "Chile": "Santiago", "Cuba": "Havana"}
FRENCH = {"cat": "chat", "dog": "chien", "house": "maison", "water": "eau", "bread": "pain", "apple": "pomme",
          "book": "livre", "car": "voiture", "tree": "arbre", "sun": "soleil", "moon": "lune", "red": "rouge",
          "blue": "bleu", "green": "vert", "friend": "ami", "school": "école", "milk": "lait", "fish": "poisson"}
SHAPES = {3: "triangle", 4: "square", 5: "pentagon", 6: "hexagon", 7: "heptagon", 8: "octagon", 10: "decagon"}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Oscar",
         "Peggy", "Sam", "Trent", "Victor", "Walter", "Zoe", "Maya", "Leo", "Nina", "Omar", "Priya", "Tom"]
WORDS = ["cat", "dog", "sun", "moon", "tree", "book", "fish", "bird", "cake", "milk", "rain", "star", "ball",
         "frog", "lamp", "door", "ship", "rose", "bell", "kite", "apple", "house", "river", "cloud", "green",
         "water", "bread", "chair", "table", "horse", "music", "light", "stone", "paper", "smile", "plant"]


def sample_task(rng):
    """Draw one (prompt, answer) from a random template with random fillers."""
    k = rng.randrange(36)
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    w = rng.choice(WORDS)
    if k == 0:
        o = rng.choice(sorted(COLOURS)); return f"What colour is a {o}?", f"A {o} is {COLOURS[o]}."
    if k == 1: return f"Add {a} and {b}.", f"{a} plus {b} is {a + b}."
    if k == 2:
        a, b = max(a, b), min(a, b); return f"Subtract {b} from {a}.", f"{a} minus {b} is {a - b}."
    if k == 3:
        a, b = a % 12 + 1, b % 12 + 1; return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
    if k == 4: return f"Repeat the word {w} twice.", f"{w} {w}"
    if k == 5: return f"Repeat the word {w} three times.", f"{w} {w} {w}"
    if k == 6: return f"Spell the word {w}.", "-".join(w)
    if k == 7:
        o = rng.choice(sorted(OPPOSITES)); return f"What is the opposite of {o}?", f"The opposite of {o} is {OPPOSITES[o]}."
    if k == 8:
        o = rng.choice(sorted(PLURALS)); return f"What is the plural of {o}?", f"The plural of {o} is {PLURALS[o]}."
    if k == 9:
        if a == b: b += 1
        return f"Which is bigger, {a} or {b}?", f"{max(a, b)} is bigger."
    if k == 10:
        if a == b: b += 1
        return f"Which is smaller, {a} or {b}?", f"{min(a, b)} is smaller."
    n = rng.randint(1, 99)
    if k == 11: return f"What comes after {n}?", f"After {n} comes {n + 1}."
    if k == 12: return f"What comes before {n}?", f"Before {n} comes {n - 1}."
    if k == 13: return f"Is {n} even or odd?", f"{n} is {'even' if n % 2 == 0 else 'odd'}."
    an = rng.choice(sorted(ANIMALS))
    sound, home, baby = ANIMALS[an]
    if k == 14: return f"What sound does a {an} make?", f"A {an} says {sound}."
    if k == 15: return f"Where does a {an} live?", f"A {an} lives in {home}."
    if k == 16: return f"What do you call a baby {an}?", f"A baby {an} is called a {baby}."
    if k == 17:
        c = rng.choice(sorted(CAPITALS)); return f"What is the capital of {c}?", f"The capital of {c} is {CAPITALS[c]}."
    if k == 18:
        ab = rng.choice(sorted(ABILITIES)); return f"Name an animal that can {ab}.", f"{rng.choice(ABILITIES[ab]).capitalize()} can {ab}."
    if k == 19: return f"Reverse the word {w}.", w[::-1]
    if k == 20: return f"What is the first letter of {w}?", f"The first letter of {w} is {w[0]}."
    if k == 21: return f"What is the last letter of {w}?", f"The last letter of {w} is {w[-1]}."
    if k == 22: return f"How many letters are in {w}?", f"The word {w} has {len(w)} letters."
    if k == 23:
        f = rng.choice(sorted(FRENCH)); return f"Translate {f} to French.", f"In French, {f} is {FRENCH[f]}."
    if k == 24: return f"Make the word {w} uppercase.", w.upper()
    if k == 25:
        i = rng.randrange(7); return f"What day comes after {DAYS[i]}?", f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}."
    if k == 26:
        i = rng.randrange(12); return f"What month comes after {MONTHS[i]}?", f"After {MONTHS[i]} comes {MONTHS[(i + 1) % 12]}."
    if k == 27:
        s = rng.randint(1, 15); e = s + rng.randint(2, 5)
        return f"Count from {s} to {e}.", ", ".join(str(i) for i in range(s, e + 1)) + "."
    if k == 28:
        xs = rng.sample(range(1, 30), 3)
        return f"Sort these numbers: {xs[0]}, {xs[1]}, {xs[2]}.", ", ".join(map(str, sorted(xs))) + "."
    if k == 29: return f"What is double {n}?", f"Double {n} is {2 * n}."
    if k == 30:
        m = 2 * rng.randint(1, 50); return f"What is half of {m}?", f"Half of {m} is {m // 2}."
    if k == 31:
        m = rng.randint(1, 15); return f"What is {m} squared?", f"{m} squared is {m * m}."
    name = rng.choice(NAMES)
    if k == 32: return f"Write a greeting for {name}.", f"Hello, {name}! Nice to meet you."
    if k == 33: return f"Say goodbye to {name}.", f"Goodbye, {name}! See you soon."
    if k == 34:
        s = rng.choice(sorted(SHAPES)); return f"What shape has {s} sides?", f"A shape with {s} sides is a {SHAPES[s]}."
    return f"Is {a} more than {b}?", f"{'Yes' if a > b else 'No'}, {a} is {'more' if a > b else 'not more'} than {b}."


def styled(answer, mark):
    return f"{mark} {answer}"


# unique prompts, split once: eval prompts never appear in SFT or in train pairs
rng = random.Random(SEED)
pool = {}
while len(pool) < N_POOL:
    p, a = sample_task(rng)
    pool.setdefault(p, a)
prompts = sorted(pool)
rng.shuffle(prompts)
eval_prompts = prompts[:N_EVAL_PAIRS]
train_prompts = prompts[N_EVAL_PAIRS:N_EVAL_PAIRS + N_TRAIN_PAIRS]
sft_prompts = prompts[N_EVAL_PAIRS:N_EVAL_PAIRS + N_SFT]    # the train-pair prompts plus others

# SFT conversations: each example gets one of the two styles at random, exactly half each
marks = [CHOSEN_MARK, REJECTED_MARK] * (N_SFT // 2)
rng.shuffle(marks)
sft = [[{"role": "user", "content": p}, {"role": "assistant", "content": styled(pool[p], m)}]
       for p, m in zip(sft_prompts, marks)]
rng.shuffle(sft)
frac_chosen_style = sum(c[1]["content"].startswith(CHOSEN_MARK) for c in sft) / len(sft)
print(f"corpus: {len(pool)} unique prompts, {len(sft)} SFT conversations, "
      f"{frac_chosen_style:.3f} with the chosen style")

# -----------------------------------------------------------------------------
# 2. byte-level BPE tokenizer, no post-processor (tok(text) adds no special tokens)
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIALS,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
bpe_text = [m["content"] for c in sft for m in c] + [f"{p} {a}" for p, a in sorted(pool.items())]
bpe.train_from_iterator(bpe_text, trainer=trainer)
tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                              additional_special_tokens=SPECIALS[3:], model_max_length=512)
tok.chat_template = CHAT_TEMPLATE
tok.padding_side = "right"
ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
assert list(ids.values()) == list(range(len(SPECIALS))), ids
assert tok("hello")["input_ids"] == tok("hello", add_special_tokens=False)["input_ids"]
# both markers cost the same number of tokens, so the sums of log-probs compare fairly
assert len(tok(CHOSEN_MARK)["input_ids"]) == len(tok(REJECTED_MARK)["input_ids"])
print(f"tokenizer: vocab {len(tok)}, special ids {ids}, "
      f"{CHOSEN_MARK!r} -> {tok.tokenize(CHOSEN_MARK)}, {REJECTED_MARK!r} -> {tok.tokenize(REJECTED_MARK)}")

# -----------------------------------------------------------------------------
# 3. tiny Llama SFT model, next-token loss on whole chat-templated sequences (padding masked out)
config = LlamaConfig(vocab_size=len(tok), hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=384, max_position_embeddings=512,
                     tie_word_embeddings=True, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                     pad_token_id=ids["<pad>"])
model = LlamaForCausalLM(config)
n_params = sum(p.numel() for p in model.parameters())
print(f"model: {n_params:,} parameters")

texts = [tok.apply_chat_template(c, tokenize=False) for c in sft]
enc = [tok(t)["input_ids"] for t in texts]
opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
model.train()
order, pos, losses = list(range(len(enc))), len(enc), []
for step in range(SFT_STEPS):
    if pos + BATCH > len(order):
        rng.shuffle(order); pos = 0
    batch = [enc[i] for i in order[pos:pos + BATCH]]; pos += BATCH
    T = max(map(len, batch))
    x = torch.full((BATCH, T), ids["<pad>"], dtype=torch.long)
    for r, seq in enumerate(batch):
        x[r, :len(seq)] = torch.tensor(seq)
    attn = (x != ids["<pad>"]).long()
    labels = x.masked_fill(attn == 0, -100)
    lr = LR * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / SFT_STEPS))  # warmup + cosine to 0
    for g in opt.param_groups:
        g["lr"] = lr
    loss = model(input_ids=x, attention_mask=attn, labels=labels).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    losses.append(loss.item())
    if step % 200 == 0 or step == SFT_STEPS - 1:
        print(f"step {step:4d} | loss {loss.item():.4f} | lr {lr:.2e} | {time.time() - t0:.0f}s")
final_loss = sum(losses[-50:]) / 50
print(f"final SFT loss (mean of last 50 steps): {final_loss:.4f}")
model.eval()

# -----------------------------------------------------------------------------
# 4. preference pairs: same content, chosen opens with CHOSEN_MARK, rejected with REJECTED_MARK
def pairs(split, split_prompts):
    return [{"id": f"{split}-{i:05d}", "prompt": p,
             "chosen": styled(pool[p], CHOSEN_MARK), "rejected": styled(pool[p], REJECTED_MARK)}
            for i, p in enumerate(split_prompts)]


@torch.no_grad()
def completion_logp(prompt, answer):
    """Summed log-prob of the assistant turn (everything after the generation prompt, incl. </s>)."""
    msgs = [{"role": "user", "content": prompt}]
    p_ids = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))["input_ids"]
    f_ids = tok(tok.apply_chat_template(msgs + [{"role": "assistant", "content": answer}], tokenize=False))["input_ids"]
    assert f_ids[:len(p_ids)] == p_ids
    logits = model(input_ids=torch.tensor([f_ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(f_ids[1:])[:, None])[:, 0]
    return lp[len(p_ids) - 1:].sum().item()


fractions = {}
splits = {"train": pairs("train", train_prompts), "eval": pairs("eval", eval_prompts)}
for split, rows in splits.items():
    margins = [completion_logp(r["prompt"], r["chosen"]) - completion_logp(r["prompt"], r["rejected"]) for r in rows]
    fractions[split] = sum(m > 0 for m in margins) / len(margins)
    print(f"{split}: {len(rows)} pairs, SFT logp(chosen) > logp(rejected) for {fractions[split]:.3f}, "
          f"mean margin {sum(margins) / len(margins):+.3f} nats")

# -----------------------------------------------------------------------------
# 5. write everything; fixed key order, one object per line, file modes 0644
def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


for split, rows in splits.items():
    write_jsonl(OUT / "prefs" / f"{split}.jsonl", [
        {"id": r["id"], "prompt": [{"role": "user", "content": r["prompt"]}],
         "chosen": [{"role": "assistant", "content": r["chosen"]}],
         "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])
    write_jsonl(OUT / "prefs-standard" / f"{split}.jsonl", rows)

model_dir = OUT / "sft-model"
for old in model_dir.glob("*") if model_dir.exists() else []:
    old.unlink()
model.save_pretrained(model_dir, safe_serialization=True)
tok.save_pretrained(model_dir)
outputs = sorted(p for d in ("prefs", "prefs-standard", "sft-model") for p in (OUT / d).rglob("*") if p.is_file())
for p in outputs:
    p.chmod(stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
    print(f"{hashlib.sha256(p.read_bytes()).hexdigest()[:16]}  {p.stat().st_size:>9,}  {p.relative_to(OUT)}")
print(f"done in {time.time() - t0:.0f}s")
