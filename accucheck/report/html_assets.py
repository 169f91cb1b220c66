"""The diff page's inline CSS and JavaScript (accucheck.report.html_diff), as strings: no CDN,
no network, nothing loaded. Imports nothing.

The script reads one JSON blob (`<script type="application/json" id="acc-cells">`: a list of
cells, FIELDS below in order) and does two things: the step switch (one heatmap panel at a time;
without JavaScript every panel shows) and the detail box (hover a cell to see its worst record's
metrics, click to pin it).
"""
from __future__ import annotations

# the order of a cell's fields in the JSON blob; the script names them in the same order
FIELDS = ("key", "status", "basis", "rel_l2", "cosine", "max_abs", "tolerance", "control_ratio",
          "excess", "threshold", "input_rel_l2", "input_from", "records", "per_request",
          "golden", "marks")
TEXT_FIELDS = ("key", "status", "basis", "input_from", "records", "golden")  # shown as they are

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px 24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 8px}h2{font-size:17px;margin:24px 0 8px}h3{font-size:15px;margin:8px 0}
#verdict{font:600 14px/1.5 ui-monospace,monospace;padding:10px 12px;border-radius:4px;
 white-space:pre-wrap;word-break:break-word}
#verdict.fail{background:#fde8e6;border-left:6px solid #c0392b}
#verdict.pass{background:#e6f5ea;border-left:6px solid #2e8b57}
pre{background:#f6f6f6;padding:8px;overflow-x:auto;font-size:12px}
.meta{color:#555;font-size:12px}
.wrap{display:flex;gap:16px;align-items:flex-start}
#detail{position:sticky;top:8px;min-width:300px;max-width:380px;font:12px/1.5 ui-monospace,
 monospace;border:1px solid #ccc;border-radius:4px;padding:8px;background:#fafafa;
 word-break:break-all}
#detail table td{padding:0 6px 0 0;vertical-align:top}#detail table td:first-child{white-space:nowrap}
.steps button{margin:0 4px 4px 0;padding:2px 8px;border:1px solid #888;background:#fff;
 border-radius:3px;cursor:pointer}
.steps button.on{background:#333;color:#fff}
table.hm{border-collapse:collapse;font-size:10px;margin-bottom:8px}
table.hm th{font-weight:normal;padding:0 3px;white-space:nowrap}
table.hm thead th{writing-mode:vertical-rl;transform:rotate(180deg);text-align:left;
 vertical-align:bottom;max-height:160px}
table.hm td{width:16px;height:12px;padding:0;border:1px solid #fff;text-align:center;
 font-size:10px;line-height:11px;cursor:pointer}
table.hm td.e{background:#fff;cursor:default}
table.hm td.nc{background:repeating-linear-gradient(45deg,#bbb 0 2px,#eee 2px 5px)}
table.hm td.sel{outline:2px solid #000}
.z{background:#f2f8f2}.b0{background:#e3f1e3}.b1{background:#c9e6c9}.b2{background:#a6d6a6}
.b3{background:#7fc27f}.b4{background:#d8e27a}.b5{background:#fdd49e}.b6{background:#fdae6b}
.b7{background:#f16913}.b8{background:#d94801;color:#fff}.b9{background:#7f2704;color:#fff}
td.m-culprit,td.m-first{outline:2px solid #000;font-weight:bold}
td.m-sus{outline:2px dashed #7b2cbf}
.legend span{display:inline-block;min-width:44px;padding:1px 4px;margin:0 2px 2px 0;
 font-size:11px;border:1px solid #ddd}
table.t{border-collapse:collapse;font-size:12px}
table.t td,table.t th{border:1px solid #ddd;padding:2px 6px;text-align:right}
table.t td:first-child,table.t th:first-child{text-align:left}
.real{color:#c0392b;font-weight:bold}.tie{color:#8a6d00}
svg text{font:10px sans-serif}
"""

JS = """
(function(){
var F=%FIELDS%, T=%TEXT_FIELDS%;
var cells=JSON.parse(document.getElementById('acc-cells').textContent);
var box=document.getElementById('detail'), pinned=null;
function fmt(v){if(v===null||v===undefined)return '-';if(typeof v!=='number')return String(v);
 if(v===0)return '0';var a=Math.abs(v);return (a>=1e-3&&a<1e4)?v.toPrecision(3):v.toExponential(2);}
function show(td){var c=cells[+td.getAttribute('data-c')];if(!c)return;
 var rows='';for(var i=0;i<F.length;i++){var v=c[i];
  if(v===null||v===''||(Array.isArray(v)&&!v.length))continue;
  if(Array.isArray(v))v=v.map(fmt).join(', ');
  rows+='<tr><td>'+F[i]+'</td><td>'+esc(T.indexOf(F[i])>=0?String(v):fmt(v))+'</td></tr>';}
 box.innerHTML='<table>'+rows+'</table>'+(pinned?'<div>(pinned: click again to release)</div>':'');}
var ESC={'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'};
function esc(s){return String(s).replace(/[&<>"]/g,function(ch){return ESC[ch];});}
document.addEventListener('mouseover',function(e){var td=e.target.closest('td[data-c]');
 if(td&&!pinned)show(td);});
document.addEventListener('click',function(e){var td=e.target.closest('td[data-c]');if(!td)return;
 if(pinned){pinned.classList.remove('sel');}
 if(pinned===td){pinned=null;return;}
 pinned=td;td.classList.add('sel');show(td);});
var panels=document.querySelectorAll('section.panel'), bar=document.getElementById('steps');
function pick(s){for(var i=0;i<panels.length;i++)
  panels[i].style.display=(s==='all'||panels[i].getAttribute('data-step')===s)?'':'none';
 var bs=bar.querySelectorAll('button');for(var j=0;j<bs.length;j++)
  bs[j].classList.toggle('on',bs[j].getAttribute('data-step')===s);}
if(bar&&panels.length){bar.addEventListener('click',function(e){var b=e.target.closest('button');
  if(b)pick(b.getAttribute('data-step'));});
 pick(bar.getAttribute('data-first'));}
})();
"""
