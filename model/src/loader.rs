//! Loading a model with its tokenizer and chat template, from a GGUF file or an HF directory
//! (`config.json`, `*.safetensors` incl. a sharded index, `tokenizer.json`,
//! `tokenizer_config.json`), and writing an HF directory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use tokenizers::Tokenizer;
use tracing::info;

use crate::chat::ChatTemplate;
use crate::config::{Architecture, HfConfig, ModelConfig};
use crate::error::{ModelError, Result};
use crate::model::Model;
use crate::quant::QuantWeight;
use crate::tokenizer::{tokenizer_from_file, GgufTokenizerSpec};

/// A loaded model with everything needed to talk to it.
#[derive(Debug)]
pub struct ModelBundle {
    /// The weights.
    pub model: Model,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template, if the files carry one.
    pub chat_template: Option<ChatTemplate>,
    /// The validated configuration (also `model.config()`).
    pub config: ModelConfig,
    /// Token ids that end an assistant turn.
    pub eos_token_ids: Vec<u32>,
}

impl ModelBundle {
    /// The token that closes an assistant turn in a chat: ChatML's `<|im_end|>` when the
    /// vocabulary has it (ChatML templates close turns with it whatever the model's first
    /// end-of-sequence token is), else the first end-of-sequence token.
    /// Training appends it to answers so the model also learns to stop.
    pub fn end_of_turn(&self) -> Option<u32> {
        self.tokenizer
            .token_to_id("<|im_end|>")
            .or_else(|| self.eos_token_ids.first().copied())
    }

    /// Loads a `.gguf` file or an HF model directory, converting weights to `dtype` on `device`.
    pub fn load(path: &Path, dtype: DType, device: &Device) -> Result<Self> {
        if path.is_dir() {
            load_hf_dir(path, dtype, device)
        } else {
            load_gguf(path, dtype, device)
        }
    }
}

fn meta<'a>(c: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value> {
    c.metadata
        .get(key)
        .ok_or_else(|| ModelError::InvalidModel(format!("GGUF metadata {key} missing")))
}

fn meta_usize(c: &gguf_file::Content, key: &str) -> Result<usize> {
    let v = meta(c, key)?;
    Ok(match v {
        gguf_file::Value::U64(x) => *x as usize,
        gguf_file::Value::I64(x) => *x as usize,
        other => other.to_u32()? as usize,
    })
}

fn meta_f64(c: &gguf_file::Content, key: &str) -> Option<f64> {
    c.metadata.get(key).and_then(|v| match v {
        gguf_file::Value::F64(x) => Some(*x),
        other => other.to_f32().ok().map(f64::from),
    })
}

fn meta_strings(c: &gguf_file::Content, key: &str) -> Result<Vec<String>> {
    meta(c, key)?
        .to_vec()?
        .iter()
        .map(|v| Ok(v.to_string()?.clone()))
        .collect()
}

/// Undoes llama.cpp's q/k row permutation: the converter stores each head's rows interleaved
/// (`[h, d/2, 2]`) for its GPT-J-style rope; HF's layout is `[h, 2, d/2]` ("rotate half").
fn unpermute(t: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims[0];
    let rest: usize = dims[1..].iter().product();
    let hd = rows / heads;
    Ok(t.reshape((heads, hd / 2, 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?)
}

/// The row order [`unpermute`] gives a matrix of `rows` rows: row `i` of the result is row
/// `order[i]` of the file's.
fn unpermuted_order(rows: usize, heads: usize) -> Result<Vec<usize>> {
    let index = Tensor::arange(0u32, rows as u32, &Device::Cpu)?.reshape((rows, 1))?;
    Ok(unpermute(&index, heads)?
        .flatten_all()?
        .to_vec1::<u32>()?
        .into_iter()
        .map(|i| i as usize)
        .collect())
}

/// Loads a GGUF file: dequantizes every tensor (on a CPU the quantized matrices also keep their
/// blocks, which decoding multiplies with: `Model::attach_quantized`), maps llama.cpp names to HF names and rebuilds
/// the tokenizer and chat template from the metadata.
pub fn load_gguf(path: &Path, dtype: DType, device: &Device) -> Result<ModelBundle> {
    let mut file =
        std::io::BufReader::new(std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?);
    let content = gguf_file::Content::read(&mut file)?;
    let arch = meta(&content, "general.architecture")?.to_string()?.clone();
    let architecture = match arch.as_str() {
        "llama" => Architecture::Llama,
        "mistral" => Architecture::Mistral,
        "qwen2" => Architecture::Qwen2,
        other => {
            return Err(ModelError::InvalidModel(format!(
                "GGUF architecture {other:?} is not supported"
            )))
        }
    };
    let k = |s: &str| format!("{arch}.{s}");
    let tokens = meta_strings(&content, "tokenizer.ggml.tokens")?;
    let num_heads = meta_usize(&content, &k("attention.head_count"))?;
    let num_kv_heads = meta_usize(&content, &k("attention.head_count_kv")).unwrap_or(num_heads);
    let hidden = meta_usize(&content, &k("embedding_length"))?;
    let head_dim = meta_usize(&content, &k("rope.dimension_count"))
        .or_else(|_| meta_usize(&content, &k("attention.key_length")))
        .unwrap_or(hidden / num_heads.max(1));
    let eos = meta_usize(&content, "tokenizer.ggml.eos_token_id").ok();
    let bos = meta_usize(&content, "tokenizer.ggml.bos_token_id").ok();
    let tied = !content.tensor_infos.contains_key("output.weight");
    let cfg = ModelConfig {
        architecture,
        vocab_size: meta_usize(&content, &k("vocab_size")).unwrap_or(tokens.len()),
        hidden_size: hidden,
        intermediate_size: meta_usize(&content, &k("feed_forward_length"))?,
        num_layers: meta_usize(&content, &k("block_count"))?,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps: meta_f64(&content, &k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
        rope_theta: meta_f64(&content, &k("rope.freq_base")).unwrap_or(10_000.0),
        max_position_embeddings: meta_usize(&content, &k("context_length")).unwrap_or(4096),
        tie_word_embeddings: tied,
        qkv_bias: content.tensor_infos.contains_key("blk.0.attn_q.bias"),
        o_bias: content.tensor_infos.contains_key("blk.0.attn_output.bias"),
        eos_token_ids: eos.map(|e| vec![e as u32]).unwrap_or_default(),
        bos_token_id: bos.map(|b| b as u32),
    };
    cfg.check()?;
    let permuted = matches!(architecture, Architecture::Llama | Architecture::Mistral);
    let mut tensors = HashMap::new();
    // The blocks of the quantized matrices, kept for decoding on the CPU (see `quant.rs`).
    let keep_blocks = device.is_cpu();
    let mut blocks = HashMap::new();
    let names: Vec<String> = content.tensor_infos.keys().cloned().collect();
    for name in names {
        let Some(hf) = gguf_to_hf_name(&name) else {
            continue;
        };
        let q = content.tensor(&mut file, &name, &Device::Cpu)?;
        let mut t = q.dequantize(&Device::Cpu)?;
        let heads = match (
            permuted,
            name.contains(".attn_q."),
            name.contains(".attn_k."),
        ) {
            (true, true, _) => Some(num_heads),
            (true, _, true) => Some(num_kv_heads),
            _ => None,
        };
        if let Some(h) = heads {
            t = unpermute(&t, h)?;
        }
        if keep_blocks {
            if let Some(mut w) = QuantWeight::from_qtensor(&q)? {
                if let Some(h) = heads {
                    w = w.rows_in_order(&unpermuted_order(w.dims().0, h)?)?;
                }
                blocks.insert(hf.clone(), w);
            }
        }
        tensors.insert(hf, t);
    }
    let mut model = Model::from_tensors(cfg.clone(), &tensors, dtype, device)?;
    drop(tensors);
    model.attach_quantized(&blocks)?;
    drop(blocks);

    let spec = GgufTokenizerSpec {
        model: meta(&content, "tokenizer.ggml.model")?.to_string()?.clone(),
        pre: content
            .metadata
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.to_string().ok().cloned()),
        token_types: content
            .metadata
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.to_vec().ok())
            .map(|v| {
                v.iter()
                    .map(|x| match x {
                        gguf_file::Value::I32(i) => *i as i64,
                        other => other.to_u32().map(i64::from).unwrap_or(1),
                    })
                    .collect()
            })
            .unwrap_or_default(),
        merges: content
            .metadata
            .get("tokenizer.ggml.merges")
            .map(|_| meta_strings(&content, "tokenizer.ggml.merges"))
            .transpose()?
            .unwrap_or_default(),
        scores: content
            .metadata
            .get("tokenizer.ggml.scores")
            .and_then(|v| v.to_vec().ok())
            .map(|v| v.iter().map(|x| x.to_f32().unwrap_or(0.0)).collect())
            .unwrap_or_default(),
        tokens: tokens.clone(),
    };
    let tokenizer = spec.build()?;
    let tok_str = |id: Option<usize>| id.and_then(|i| tokens.get(i).cloned()).unwrap_or_default();
    let chat_template = match content.metadata.get("tokenizer.chat_template") {
        Some(v) => Some(ChatTemplate::new(
            v.to_string()?,
            &tok_str(bos),
            &tok_str(eos),
        )?),
        None => None,
    };
    let eos_token_ids = end_of_turn_ids(&tokenizer, &cfg.eos_token_ids);
    info!(path = %path.display(), layers = cfg.num_layers, vocab = cfg.vocab_size, "Loaded GGUF model.");
    Ok(ModelBundle {
        model,
        tokenizer,
        chat_template,
        config: cfg,
        eos_token_ids,
    })
}

/// The configured eos ids plus the usual end-of-turn tokens present in the vocabulary.
fn end_of_turn_ids(tokenizer: &Tokenizer, configured: &[u32]) -> Vec<u32> {
    let mut ids = configured.to_vec();
    for tok in [
        "<|im_end|>",
        "<|eot_id|>",
        "<|endoftext|>",
        "</s>",
        "<|end|>",
    ] {
        if let Some(id) = tokenizer.token_to_id(tok) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    ids
}

fn gguf_to_hf_name(name: &str) -> Option<String> {
    match name {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let hf = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::json(path.display().to_string(), e))
}

/// The safetensors files of an HF directory: from the sharded index if there is one.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let v = read_json(&index)?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::InvalidModel("index without weight_map".into()))?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(|f| f.as_str().map(|f| dir.join(f)))
            .collect();
        files.sort();
        files.dedup();
        return Ok(files);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| ModelError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::InvalidModel(format!(
            "no *.safetensors in {}",
            dir.display()
        )));
    }
    Ok(files)
}

fn token_string(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Loads an HF model directory.
pub fn load_hf_dir(dir: &Path, dtype: DType, device: &Device) -> Result<ModelBundle> {
    let text = std::fs::read_to_string(dir.join("config.json"))
        .map_err(|e| ModelError::io(dir.join("config.json"), e))?;
    let mut cfg = HfConfig::from_json(&text)?.validate()?;
    let mut tensors = HashMap::new();
    for f in safetensors_files(dir)? {
        tensors.extend(candle_core::safetensors::load(&f, &Device::Cpu)?);
    }
    let tokenizer = tokenizer_from_file(&dir.join("tokenizer.json"))?;
    let tc_path = dir.join("tokenizer_config.json");
    let tc = if tc_path.exists() {
        read_json(&tc_path)?
    } else {
        serde_json::Value::Null
    };
    let bos = token_string(tc.get("bos_token")).unwrap_or_default();
    let eos = token_string(tc.get("eos_token")).unwrap_or_default();
    let template_src = match tc.get("chat_template") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
        _ => None,
    };
    let template_src = match template_src {
        Some(s) => Some(s),
        None => {
            let jinja = dir.join("chat_template.jinja");
            if jinja.exists() {
                Some(std::fs::read_to_string(&jinja).map_err(|e| ModelError::io(&jinja, e))?)
            } else {
                None
            }
        }
    };
    let chat_template = template_src
        .map(|s| ChatTemplate::new(&s, &bos, &eos))
        .transpose()?;
    if let Some(id) = tokenizer.token_to_id(&eos) {
        if !cfg.eos_token_ids.contains(&id) {
            cfg.eos_token_ids.push(id);
        }
    }
    let model = Model::from_tensors(cfg.clone(), &tensors, dtype, device)?;
    let eos_token_ids = end_of_turn_ids(&tokenizer, &cfg.eos_token_ids);
    info!(dir = %dir.display(), layers = cfg.num_layers, "Loaded HF model directory.");
    Ok(ModelBundle {
        model,
        tokenizer,
        chat_template,
        config: cfg,
        eos_token_ids,
    })
}

/// Writes `model`'s weights (f32) and `config.json` as an HF directory (`model.safetensors`).
/// Tokenizer files are the caller's to add.
pub fn save_hf_weights(model: &Model, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let cfg = serde_json::to_string_pretty(&model.config().to_hf_json())
        .map_err(|e| ModelError::json("config.json", e))?;
    let path = dir.join("config.json");
    std::fs::write(&path, cfg).map_err(|e| ModelError::io(&path, e))?;
    let tensors = model
        .named_tensors()
        .into_iter()
        .map(|(k, v)| Ok((k, v.to_dtype(DType::F32)?.to_device(&Device::Cpu)?)))
        .collect::<Result<HashMap<String, Tensor>>>()?;
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(h, 2, d/2, in).swapaxes(1, 2).reshape(...)
        let (h, d, inp) = (3, 4, 5);
        let w = Tensor::arange(0f32, (h * d * inp) as f32, &Device::Cpu)
            .unwrap()
            .reshape((h * d, inp))
            .unwrap();
        let permuted = w
            .reshape((h, 2, d / 2, inp))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((h * d, inp))
            .unwrap();
        let back = unpermute(&permuted, h).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
        assert_ne!(
            permuted.to_vec2::<f32>().unwrap(),
            w.to_vec2::<f32>().unwrap()
        );
    }

    #[test]
    fn gguf_names_map_to_hf() {
        assert_eq!(
            gguf_to_hf_name("blk.3.attn_q.weight").as_deref(),
            Some("model.layers.3.self_attn.q_proj.weight")
        );
        assert_eq!(
            gguf_to_hf_name("blk.0.ffn_down.weight").as_deref(),
            Some("model.layers.0.mlp.down_proj.weight")
        );
        assert_eq!(gguf_to_hf_name("rope_freqs.weight"), None);
    }
}
